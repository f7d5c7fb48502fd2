"""`llmgw bench sweep TRACE`: the same trace replayed open-loop at rising offered load, from idle
through saturation, against the running gateway (llmgw/bench/openloop.py); per level, the latency
percentiles, the admission rate and the SLO gate's joint attainment (llmgw/bench/slo.py).

The knee is the highest offered load at which the gate still holds (attainment >= alpha with the
admission rate >= --min-admission). The service rate mu is the most the system completed per
second at any level, over that level's busy period (first send to last answer: saturation); utilisation at the
SLO is what it completed at the knee over mu - the figure `llmgw review` and `llmgw plan` need.
Plots (PNG): latency percentiles and attainment against offered load, the knee marked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from extproc.config import ConfigError, Snapshot, load_snapshot
from extproc.corpora import digest_of
from llmgw.bench.fairness import TenantLevels, tenant_levels, tenant_table
from llmgw.bench.load_gate import ClassLevel, at_peaks, class_gates, measure_classes
from llmgw.bench.load_gate import record as load_record
from llmgw.bench.openloop import Outcome, replay
from llmgw.bench.run import reset_prefix_caches, warn_not_cold
from llmgw.bench.slo import Gate, Sample, evaluate
from llmgw.bench.stats import percentile
from llmgw.bench.workload import TraceRecord, read
from llmgw.conformance.record import write_record


@dataclass(frozen=True)
class Level:
    speed: float
    offered_rps: float
    completed_rps: float  # answers per second over the level's busy period (completed_rate)
    admission: float
    attainment: float
    holds: bool
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    tpot_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    late_p99_s: float  # how far behind its schedule the client fell (open loop: should stay small)


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def completed_rate(outcomes: Sequence[Outcome], speed: float, wall_s: float) -> float:
    """Answers per second over the level's busy period, from its first send to its last answer.
    Below saturation that is the arrival rate, less the last answers' tail; above it, the rate the
    engines got through the work. Two estimators that looked better were wrong: counting answers
    within the sending window finds none when a level is shorter than its latency, and the rate
    between the first and last answer is inflated above saturation, when a batch that keeps
    growing (the engines admit everything) finishes its requests together."""
    sends = [o.record.at / speed + o.late_s for o in outcomes]
    done = [s + o.e2e_s for s, o in zip(sends, outcomes, strict=True) if o.e2e_s is not None]
    if not done or max(done) <= min(sends):
        return len(done) / wall_s
    return len(done) / (max(done) - min(sends))


def measure(outcomes: Sequence[Outcome], trace: Sequence[TraceRecord], speed: float, wall_s: float, gate: Gate,
            min_admission: float) -> Level:
    span = (trace[-1].at - trace[0].at) / speed if len(trace) > 1 else 1.0
    samples = [Sample(o.admitted, o.ttft_s if o.record.stream else None, o.tpot_s, o.e2e_s) for o in outcomes]
    verdict = evaluate(gate, samples)
    answered = [o for o in outcomes if o.e2e_s is not None]
    ttft = [o.ttft_s for o in answered if o.ttft_s is not None and o.record.stream]
    tpot = [o.tpot_s for o in answered if o.tpot_s is not None]
    e2e = [o.e2e_s for o in answered if o.e2e_s is not None]
    return Level(speed, len(trace) / max(span, 1e-9), completed_rate(outcomes, speed, wall_s), verdict.admission_rate,
                 verdict.attainment, verdict.eligible and verdict.admission_rate >= min_admission,
                 _p(ttft, 95), _p(ttft, 99), _p(tpot, 95), _p(e2e, 50), _p(e2e, 95), _p(e2e, 99),
                 percentile([o.late_s for o in outcomes], 99))


def knee(levels: Sequence[Level]) -> Level | None:
    """The highest offered load at which the gate holds, below the first level where it does not
    (a gate that holds again beyond saturation is noise, not capacity)."""
    best = None
    for lv in sorted(levels, key=lambda x: x.offered_rps):
        if not lv.holds:
            break
        best = lv
    return best


def plot(levels: Sequence[Level], gate: Gate, at_knee: Level | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv.offered_rps for lv in levels]
    fig, (lat, att) = plt.subplots(1, 2, figsize=(13, 4.2))
    for label, pick in (("TTFT p95", "ttft_p95_s"), ("TTFT p99", "ttft_p99_s"), ("E2E p50", "e2e_p50_s"),
                        ("E2E p95", "e2e_p95_s"), ("E2E p99", "e2e_p99_s")):
        pts = [(x, getattr(lv, pick)) for x, lv in zip(xs, levels, strict=True) if getattr(lv, pick) is not None]
        if pts:
            lat.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    lat.axhline(gate.e2e_s, color="grey", linestyle=":", label=f"E2E bound {gate.e2e_s:g} s")
    lat.set_yscale("log")
    lat.set_xlabel("offered load (requests/s)")
    lat.set_ylabel("seconds")
    lat.set_title("latency against offered load")
    att.plot(xs, [lv.attainment for lv in levels], marker="o", label="joint SLO attainment (admitted)")
    att.plot(xs, [lv.admission for lv in levels], marker="s", label="admission rate")
    att.plot(xs, [lv.completed_rps / max(lv.offered_rps, 1e-9) for lv in levels], marker="^",
             label="completed / offered")
    att.axhline(gate.alpha, color="grey", linestyle=":", label=f"alpha {gate.alpha:g}")
    att.set_ylim(-0.05, 1.05)
    att.set_xlabel("offered load (requests/s)")
    att.set_title("SLO attainment against offered load")
    for ax in (lat, att):
        if at_knee is not None:
            ax.axvline(at_knee.offered_rps, color="red", linewidth=1, label=f"knee {at_knee.offered_rps:.1f} req/s")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def table(levels: Sequence[Level]) -> str:
    head = ["offered req/s", "completed req/s", "admitted", "attainment", "gate", "TTFT p95 ms", "TPOT p95 ms",
            "E2E p50 ms", "E2E p95 ms", "E2E p99 ms", "send lateness p99 ms"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        rows.append(f"| {lv.offered_rps:.1f} | {lv.completed_rps:.1f} | {lv.admission:.1%} | {lv.attainment:.1%} | "
                    f"{'holds' if lv.holds else 'MISSED'} | {_s(lv.ttft_p95_s)} | {_s(lv.tpot_p95_s)} | "
                    f"{_s(lv.e2e_p50_s)} | {_s(lv.e2e_p95_s)} | {_s(lv.e2e_p99_s)} | {lv.late_p99_s * 1000:.1f} |")
    return "\n".join(rows)


def _policy_gates(args: argparse.Namespace, trace: Sequence[TraceRecord]
                  ) -> tuple[Snapshot | None, dict[str, Gate], dict[str, float]]:
    """With --config: the policy, each traced class's gate from its objective, their peak rates."""
    if not args.config:
        if args.evidence:
            raise ValueError("--evidence needs --config: the request classes' objectives and where records go")
        return None, {}, {}
    snap = load_snapshot(args.config)
    classes = sorted({r.request_class for r in trace})
    gates = class_gates(snap, classes)
    peaks = {c: p for c in classes if (p := snap.gateway.request_classes[c].slo.peak_rps) is not None}  # type: ignore[union-attr]
    if args.evidence and set(peaks) != set(classes):
        raise ValueError(f"--evidence judges each class at its peak rate: declare slo.peak_rps for "
                         f"{', '.join(sorted(set(classes) - set(peaks)))}")
    return snap, gates, peaks


def cmd_sweep(args: argparse.Namespace) -> int:
    up: dict[str, Any] = json.loads((Path(args.state_dir) / "up.json").read_text())
    trace = read(Path(args.trace))
    keys = {t: v["api_key"] for t, v in up["tenants"].items()}
    try:
        snap, gates, peaks = _policy_gates(args, trace)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gate = (next(iter(gates.values())) if gates and not args.request_class else
            Gate(args.request_class or trace[0].request_class, args.ttft, args.tpot, args.e2e, args.alpha))
    url = f"{up['url']}/v1/chat/completions"
    levels = []
    per_class: list[tuple[ClassLevel, ...]] = []  # with --config: every class at each level (the gate is joint)
    per_tenant: list[TenantLevels] = []  # what each tenant got, and Jain's indices
    weights = {t: v.weight for t, v in snap.gateway.tenants.items()} if snap is not None else {}
    served: list[set[str]] = []  # the candidates that answered at each level
    raw: list[list[dict[str, Any]]] = []  # each level's requests, for a second look at the figures
    for speed in (float(s) for s in args.speeds.split(",")):
        warn_not_cold(reset_prefix_caches(up.get("engines", [])))  # every level starts idle and cold
        t0 = time.monotonic()
        outcomes = asyncio.run(replay(url, keys, trace, speed, args.exact_lengths))
        wall = time.monotonic() - t0
        lv = measure([o for o in outcomes if o.record.request_class == gate.request_class],
                     [r for r in trace if r.request_class == gate.request_class], speed, wall, gate, args.min_admission)
        classes = measure_classes(outcomes, trace, speed, gates, args.min_admission) if gates else ()
        lv = replace(lv, holds=lv.holds and all(c.holds for c in classes))
        levels.append(lv)
        per_class.append(classes)
        per_tenant.append(tenant_levels(outcomes, trace, speed, weights, gates or {gate.request_class: gate}))
        served.append({o.deployment for o in outcomes if o.deployment})
        raw.append([{"at": o.record.at, "tenant": o.record.tenant, "request_class": o.record.request_class,
                     "late_s": o.late_s, "status": o.status, "code": o.code, "ttft_s": o.ttft_s,
                     "tpot_s": o.tpot_s, "e2e_s": o.e2e_s, "output_tokens": o.output_tokens} for o in outcomes])
        print(f"speed {speed:g}: offered {lv.offered_rps:.1f} req/s, completed {lv.completed_rps:.1f}/s, "
              f"attainment {lv.attainment:.1%}, admission {lv.admission:.1%}", file=sys.stderr)
        time.sleep(args.pause)  # let the engines drain before the next level
    at_knee = knee(levels)
    mu = max(lv.completed_rps for lv in levels)
    util = at_knee.completed_rps / mu if at_knee and mu else None
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(levels, gate, at_knee, out / "sweep.png")
    route = trace[0].route
    (out / "sweep.json").write_text(json.dumps({
        "gate": asdict(gate), "levels": [asdict(lv) for lv in levels], "requests": raw,
        "classes": [[asdict(c) for c in cs] for cs in per_class],
        "tenants": [[{"request_class": c, "jain": j, "jain_within_objective": g, "tenants": [asdict(t) for t in ts]}
                     for c, ts, j, g in level] for level in per_tenant], "mu_rps": mu,
        "knee_rps": at_knee.offered_rps if at_knee else None,
        "slo_utilization": {route: util} if util is not None else {}}, indent=2))
    text = (f"# Sweep of {args.trace} on route {route} ({len(trace)} requests per level)\n\n"
            f"gate ({gate.request_class}): TTFT <= {gate.ttft_s:g} s, TPOT <= {gate.tpot_s:g} s, "
            f"E2E <= {gate.e2e_s:g} s for >= {gate.alpha:.0%} of admitted, admission >= {args.min_admission:.0%}\n\n"
            f"{table(levels)}\n\n"
            + (f"knee: {at_knee.offered_rps:.1f} req/s offered; mu (most completed at any level): {mu:.1f} req/s; "
               f"utilisation at the SLO: {util:.0%}\n" if at_knee and util is not None
               else f"knee: none - the gate does not hold even at the lowest level; mu {mu:.1f} req/s\n")
            + f"\nplots: {out / 'sweep.png'}; data: {out / 'sweep.json'}\n")
    if gates:
        text += ("\nper request class (the gate holds at a level when every class does):\n\n"
                 + class_table(levels, per_class))
    if len({r.tenant for r in trace}) > 1:
        text += ("\nper request class and tenant (admitted against its max-min fair share of what the class was "
                 "admitted, by weight):\n\n"
                 + tenant_table([lv.speed for lv in levels], per_tenant))
    if args.evidence and snap is not None:
        text += _write_load_evidence(args, snap, trace, peaks, per_class, served, mu,
                                     at_knee.offered_rps if at_knee else None)
    print(text)
    (out / "sweep.md").write_text(text)
    return 0


def class_table(levels: Sequence[Level], per_class: Sequence[tuple[ClassLevel, ...]]) -> str:
    head = ["level offered req/s", "class", "offered req/s", "admitted", "refused overloaded", "joint attainment",
            "TTFT p99 ms", "TPOT p99 ms", "gate"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv, classes in zip(levels, per_class, strict=True):
        rows += [f"| {lv.offered_rps:.1f} | {c.request_class} | {c.offered_rps:.2f} | {c.admission:.1%} | "
                 f"{c.overloaded:.1%} | {c.attainment:.1%} | {_s(c.ttft_p99_s)} | {_s(c.tpot_p99_s)} | "
                 f"{'holds' if c.holds else 'MISSED'} |" for c in classes]
    return "\n".join(rows) + "\n"


def _write_load_evidence(args: argparse.Namespace, snap: Snapshot, trace: Sequence[TraceRecord],
                         peaks: dict[str, float], per_class: Sequence[tuple[ClassLevel, ...]],
                         served: Sequence[set[str]], mu: float, knee_rps: float | None) -> str:
    """The load record for each candidate that answered the route at the levels each class was judged at."""
    judged = at_peaks(per_class, peaks)
    route = snap.routes[trace[0].route]
    doc = load_record(snap, peaks, judged, mu, knee_rps, Path(args.trace).name, datetime.now(UTC).date(),
                      args.valid_days)
    digest = digest_of([asdict(r) for r in trace])
    deployments = sorted(set().union(*(served[i] for i, _ in judged.values())) & set(snap.deployments))
    lines = [f"\nload evidence ({doc['result']}) at the declared peaks "
             f"({', '.join(f'{c} {p:g} req/s' for c, p in sorted(peaks.items()))}):"]
    for name in deployments:
        path = write_record(Path(args.config), snap, name, route,
                            {**doc, "deployment_ref": snap.deployments[name].ref}, digest)
        lines.append(f"  wrote {path}")
    return "\n".join(lines or ["  no candidate answered"]) + "\n"


def register(bsub: Any) -> None:
    s = bsub.add_parser("sweep", help="a trace replayed open-loop from idle through saturation: the knee and plots")
    s.add_argument("trace")
    s.add_argument("--state-dir", default=".llmgw")
    s.add_argument("--speeds", default="0.25,0.5,1,2,4,8", help="offered-load multiples of the trace's own rate")
    s.add_argument("--request-class", help="the gated class (default: the trace's first)")
    s.add_argument("--ttft", type=float, default=1.0, help="F: TTFT bound, seconds")
    s.add_argument("--tpot", type=float, default=0.1, help="D: TPOT bound, seconds")
    s.add_argument("--e2e", type=float, default=20.0, help="L: end-to-end bound, seconds")
    s.add_argument("--alpha", type=float, default=0.95)
    s.add_argument("--min-admission", type=float, default=0.99)
    s.add_argument("--pause", type=float, default=2.0, help="seconds between levels")
    s.add_argument("--no-exact-lengths", dest="exact_lengths", action="store_false")
    s.add_argument("-o", "--output-dir", default=".llmgw/sweep")
    s.add_argument("--config", help="the policy: gate every request class of the trace jointly on its objective "
                                    "(gateway.yaml request_classes.<c>.slo) instead of the flags above")
    s.add_argument("--evidence", action="store_true",
                   help="(with --config) write a `load` record for each candidate that answered the route, judged "
                        "at each class's declared peak rate (slo.peak_rps)")
    s.add_argument("--valid-days", type=int, default=30, help="(--evidence) the record expires this many days on")
    s.set_defaults(func=cmd_sweep)
