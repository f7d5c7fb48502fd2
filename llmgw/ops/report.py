"""`llmgw report`: one self-contained HTML page from the ledger and the metrics.

The ledger is the source of every figure about requests (it is unsampled: one entry per
authenticated request, invariant 8, docs/INVARIANTS.md): latencies per route and request class over time
beside the admitted, refused and timed-out fractions, spend by tenant, route and deployment,
attempts by kind, and each budget's burn-down in its current window. The metrics (the host's
Prometheus text) add what the ledger does not hold: the gateway's counters as its workers counted
them. Plots are matplotlib PNGs embedded as data URIs, so the page needs nothing but itself.

Every figure says how many points it drew (`data-points`); a figure with none says "no data"
instead of drawing empty axes.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to PNG only

import matplotlib.dates as mdates  # after the backend is chosen
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from prometheus_client.parser import text_string_to_metric_families

from extproc.config import Snapshot
from extproc.config.schema import Budget
from llmgw.bench.stats import percentile
from llmgw.ops.ledger import ttft_ms

PERCENTILES = (50, 95, 99)
TIMED_OUT = ("deadline",)
REFUSED = ("refused", "denied")
MAX_GROUPS = 8  # (route, request class) pairs drawn, the busiest first; the table lists them all
LINE_STYLES = {50: "-", 95: "--", 99: ":"}


@dataclass(frozen=True)
class Request:
    """One ledger entry, as the report reads it."""

    time: float  # epoch seconds of arrival
    tenant: str
    route: str
    request_class: str
    deployment: str  # the candidate that answered last ("" when none did)
    termination: str
    admitted: bool  # it reserved (reached dispatch)
    stream: bool
    spent_micros: int
    tokens: int
    ttft_s: float | None  # streams that completed: arrival to first content token
    tpot_s: float | None  # streams that completed with more than one output token
    e2e_s: float | None  # requests that completed: arrival to last byte
    attempt_kinds: tuple[str, ...]
    subject: str


def reading(entry: Mapping[str, Any]) -> Request:
    attempts = entry.get("attempts") or []
    usage = entry.get("usage") or {}
    output = int(usage.get("completion_tokens") or 0)
    complete = entry.get("termination") == "complete"
    stream = bool(entry.get("stream"))
    duration = _seconds(entry.get("duration_ms")) if complete else None
    first = _seconds(ttft_ms(entry)) if complete and stream else None
    tpot = (duration - first) / (output - 1) if duration is not None and first is not None and output > 1 else None
    return Request(
        time=float(entry.get("time") or 0.0), tenant=str(entry.get("tenant", "")),
        route=str(entry.get("route") or "(no route)"), request_class=str(entry.get("request_class") or "-"),
        deployment=str(attempts[-1].get("deployment", "")) if attempts else "",
        termination=str(entry.get("termination", "")), admitted=entry.get("settlement", "none") != "none",
        stream=stream, spent_micros=int(entry.get("charged_micros") or 0),
        tokens=int(entry.get("charged_tokens") or 0), ttft_s=first, tpot_s=tpot, e2e_s=duration,
        attempt_kinds=tuple(str(a.get("kind") or ("first" if i == 0 else "retry")) for i, a in enumerate(attempts)),
        subject=str(entry.get("subject", "")))


def _seconds(ms: Any) -> float | None:
    return None if ms is None else float(ms) / 1000


@dataclass
class Section:
    title: str
    body: str  # HTML
    points: int = 0  # data points its figures drew


@dataclass
class Report:
    generated: datetime
    revision: str
    requests: list[Request]
    sections: list[Section] = field(default_factory=list)


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _figure(title: str, fig: Figure | None, points: int) -> str:
    if fig is None or points == 0:
        if fig is not None:
            plt.close(fig)
        return (f'<figure data-points="0"><figcaption>{html.escape(title)}</figcaption>'
                '<p class="empty">no data</p></figure>')
    return (f'<figure data-points="{points}"><img alt="{html.escape(title)}" src="data:image/png;base64,{_png(fig)}">'
            f"<figcaption>{html.escape(title)}</figcaption></figure>")


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _pcts(values: Sequence[float]) -> list[str]:
    return [_ms(percentile(values, p)) if values else "-" for p in PERCENTILES]


def _bins(requests: Sequence[Request], count: int = 24) -> tuple[float, float]:
    """(start, width) of `count` time bins over the requests' arrivals (at least 1 s wide)."""
    start = min(r.time for r in requests)
    span = max(r.time for r in requests) - start
    return start, max(1.0, span / count)


def latency_section(requests: Sequence[Request], currency: str) -> Section:
    groups: dict[tuple[str, str], list[Request]] = defaultdict(list)
    for r in requests:
        groups[(r.route, r.request_class)].append(r)
    rows = []
    for (route, cls), rs in sorted(groups.items()):
        n = len(rs)
        rows.append([route, cls, n, f"{sum(r.admitted for r in rs) / n:.1%}",
                     f"{sum(r.termination in REFUSED for r in rs) / n:.1%}",
                     f"{sum(r.termination in TIMED_OUT for r in rs) / n:.1%}",
                     *_pcts([r.ttft_s for r in rs if r.ttft_s is not None]),
                     *_pcts([r.tpot_s for r in rs if r.tpot_s is not None]),
                     *_pcts([r.e2e_s for r in rs if r.e2e_s is not None]),
                     f"{sum(r.spent_micros for r in rs) / 1e6:.6f}"])
    head = ["route", "class", "requests", "admitted", "refused", "timed out",
            *(f"TTFT p{p} ms" for p in PERCENTILES), *(f"TPOT p{p} ms" for p in PERCENTILES),
            *(f"E2E p{p} ms" for p in PERCENTILES), f"spend {currency}"]
    body = [_table(head, rows)]
    points = 0
    busiest = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:MAX_GROUPS]
    for (route, cls), rs in busiest:
        fig, n = _over_time(rs)
        body.append(_figure(f"{route} / {cls}: latency percentiles and outcome fractions over time", fig, n))
        points += n
    return Section("Latency and outcomes per route and request class", "".join(body), points)


def _time_axis(ax: Any, start: float, end: float, pad: float) -> None:
    """UTC times on the x axis, over [start - pad, end + pad] (a run within one bin still gets a span)."""
    locator = mdates.AutoDateLocator(tz=UTC)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    ax.set_xlim(mdates.date2num(datetime.fromtimestamp(start - pad, UTC)),
                mdates.date2num(datetime.fromtimestamp(end + pad, UTC)))


def _over_time(rs: Sequence[Request]) -> tuple[Figure, int]:
    start, width = _bins(rs)
    binned: dict[int, list[Request]] = defaultdict(list)
    for r in rs:
        binned[int((r.time - start) // width)].append(r)
    order = sorted(binned)
    at = [datetime.fromtimestamp(start + (b + 0.5) * width, UTC) for b in order]  # each bin's middle
    end = start + (order[-1] + 1) * width
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    points = 0
    for ax, (label, pick) in zip(axes[:3], (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end to end", "e2e_s")),
                                 strict=True):
        for p in PERCENTILES:
            xs, ys = [], []
            for b, x in zip(order, at, strict=True):
                vals = [v for r in binned[b] if (v := getattr(r, pick)) is not None]
                if vals:
                    xs.append(x)
                    ys.append(percentile(vals, p) * 1000)
            if xs:
                ax.plot(xs, ys, LINE_STYLES[p], marker=".", label=f"p{p}")
                points += len(xs)
        ax.set_title(f"{label} (ms)")
        _time_axis(ax, start, end, width / 2)
        if ax.lines:
            ax.legend(fontsize="small")
        else:  # e.g. TTFT of a route that served no completed stream
            ax.text(0.5, 0.5, "no completed request of this kind", ha="center", va="center",
                    transform=ax.transAxes, color="#a00")
    ax = axes[3]
    for k, pred in (("admitted", lambda r: r.admitted), ("refused", lambda r: r.termination in REFUSED),
                    ("timed out", lambda r: r.termination in TIMED_OUT)):
        ax.plot(at, [sum(pred(r) for r in binned[b]) / len(binned[b]) for b in order], marker=".", label=k)
    points += len(at)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("fraction of requests")
    _time_axis(ax, start, end, width / 2)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig, points


def _bars(ax: Any, title: str, counts: Mapping[str, float]) -> int:
    items = sorted(counts.items(), key=lambda kv: kv[1])
    ax.barh([k or "(none)" for k, _ in items], [v for _, v in items])
    ax.set_title(title)
    ax.xaxis.set_major_locator(plt.MaxNLocator(4))
    return len(items)


def spend_section(requests: Sequence[Request], currency: str) -> Section:
    by: dict[str, dict[str, float]] = {"tenant": defaultdict(float), "route": defaultdict(float),
                                       "deployment": defaultdict(float)}
    for r in requests:
        if r.spent_micros:
            for key, value in (("tenant", r.tenant), ("route", r.route), ("deployment", r.deployment)):
                by[key][value] += r.spent_micros / 1e6
    fig, axes = plt.subplots(1, 3, figsize=(16, 3.2))
    points = sum(_bars(ax, f"spend by {key} ({currency})", counts) for ax, (key, counts) in zip(axes, by.items(),
                                                                                              strict=True))
    fig.tight_layout()
    rows = [[key, name, f"{v:.6f}"] for key, counts in by.items() for name, v in sorted(counts.items())]
    return Section("Spend", _figure(f"Spend by tenant, route and deployment ({currency})", fig, points)
                   + _table(["by", "name", f"spend {currency}"], rows), points)


def attempts_section(requests: Sequence[Request]) -> Section:
    kinds = Counter(k for r in requests for k in r.attempt_kinds)
    fallbacks = Counter(r.route for r in requests if "model_fallback" in r.attempt_kinds)
    retried = Counter(r.route for r in requests if len(r.attempt_kinds) > 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.0))
    points = _bars(axes[0], "upstream attempts by kind", kinds)
    points += _bars(axes[1], "requests that fell back, by route", fallbacks)
    fig.tight_layout()
    rows = [[route, retried[route], fallbacks[route]] for route in sorted(retried)]
    return Section("Attempts and fallbacks", _figure("Attempts by kind; fallbacks by route", fig, points)
                   + _table(["route", "requests with more than one attempt", "of which fell back"], rows), points)


def _window_start(budget: Budget, now: datetime) -> float:
    if budget.window == "daily":
        return datetime(now.year, now.month, now.day, tzinfo=UTC).timestamp()
    if budget.window == "monthly":
        return datetime(now.year, now.month, 1, tzinfo=UTC).timestamp()
    return 0.0


def budgets_section(requests: Sequence[Request], budgets: Sequence[Budget], now: datetime) -> Section:
    """Each budget's use in its current window, from the ledger's charges (settled amounts: what is
    reserved right now is not in the ledger yet), against its limit."""
    body, points, rows = [], 0, []
    for b in budgets:
        since = _window_start(b, now)
        charged = sorted((r.time, r.spent_micros, r.tokens) for r in requests
                         if r.time >= since and b.matches(r.tenant, r.subject, r.route))
        for unit, limit, idx, scale in (("micros", b.limit_micros, 1, 1e6), ("tokens", b.limit_tokens, 2, 1.0)):
            if limit is None:
                continue
            used, xs, ys = 0.0, [], []
            for c in charged:
                used += c[idx]
                xs.append(datetime.fromtimestamp(c[0], UTC))
                ys.append(limit / scale - used / scale)
            what = "money" if unit == "micros" else "tokens"
            rows.append([b.name, b.tenant, b.window, what, f"{limit / scale:g}", f"{used / scale:g}",
                         f"{(limit - used) / scale:g}", f"{used / limit:.2%}" if limit else "-"])
            if not xs:
                body.append(_figure(f"budget {b.name} ({what}): no charges in this window", None, 0))
                continue
            fig, ax = plt.subplots(figsize=(8, 2.8))
            ax.step(mdates.date2num(xs), ys, where="post", marker=".", label="remaining")
            ax.axhline(0, color="red", linewidth=1, label="exhausted")
            ax.set_ylim(min(0.0, min(ys)) - limit / scale * 0.05, limit / scale * 1.05)
            ax.set_title(f"{b.name}: remaining {what} in the {b.window} window ({used / limit:.2%} used)")
            ax.legend(fontsize="small")
            first, last = charged[0][0], charged[-1][0]
            _time_axis(ax, first, last, max(1.0, (last - first) * 0.05))
            body.append(_figure(f"budget {b.name} ({what}) burn-down", fig, len(xs)))
            points += len(xs)
    head = ["budget", "tenant", "window", "of", "limit", "used (ledger)", "remaining", "used"]
    return Section("Budgets", _table(head, rows) + "".join(body), points)


def metrics_section(text: str | None, source: str) -> Section:
    """The gateway's own counters (llmgw_*) from the host's Prometheus text, summed per label set."""
    if text is None:
        return Section("Gateway counters", f'<p class="empty">no metrics: {html.escape(source)}</p>')
    rows = []
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("llmgw_"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ", ".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            rows.append([s.name, labels, f"{s.value:g}"])
    return Section("Gateway counters", f"<p>from {html.escape(source)}</p>" + _table(["metric", "labels", "value"],
                                                                                     rows))


STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1em}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px;text-align:right}th{background:#f3f3f3}
td:first-child,td:nth-child(2){text-align:left}figure{margin:.5em 0}img{max-width:100%}
figcaption{font-size:12px;color:#555}.empty{color:#a00}"""


def render(entries: Iterable[Mapping[str, Any]], snap: Snapshot, metrics_text: str | None = None,
           metrics_source: str = "", now: datetime | None = None) -> tuple[str, Report]:
    """The page's HTML, and what it holds (for callers that check it)."""
    now = now or datetime.now(UTC)
    requests = sorted((reading(e) for e in entries), key=lambda r: r.time)
    currencies = {d.prices.currency for d in snap.deployments.values()}
    currency = currencies.pop() if len(currencies) == 1 else "(mixed currencies)"
    report = Report(now, snap.revision, requests)
    if requests:
        report.sections = [latency_section(requests, currency), spend_section(requests, currency),
                           attempts_section(requests), budgets_section(requests, snap.gateway.budgets, now)]
    else:
        report.sections = [Section("Requests", '<p class="empty">the ledger holds no entries</p>')]
    report.sections.append(metrics_section(metrics_text, metrics_source))
    span = (f"{datetime.fromtimestamp(requests[0].time, UTC):%Y-%m-%d %H:%M:%S} to "
            f"{datetime.fromtimestamp(requests[-1].time, UTC):%Y-%m-%d %H:%M:%S} UTC") if requests else "-"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>llmgw report</title><style>{STYLE}</style>"
             "</head><body>", "<h1>llmgw report</h1>",
             f"<p>generated {now:%Y-%m-%d %H:%M:%S} UTC; configuration revision {html.escape(snap.revision)}; "
             f"{len(requests)} ledger entries, {span}</p>"]
    for s in report.sections:
        parts.append(f"<section data-points='{s.points}'><h2>{html.escape(s.title)}</h2>{s.body}</section>")
    parts.append("</body></html>")
    return "".join(parts), report
