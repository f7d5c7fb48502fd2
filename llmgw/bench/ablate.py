"""`llmgw bench ablate`: what every piece of the request path costs, by taking it out.

One run, the setup of `llmgw bench overhead` (a fake engine in an Envoy of its own, a bare Envoy in
front of it, the gateway with its pool pointed at the same engine). The gateway is started once per
variant, each with one piece taken out of the full configuration:
  - each HTTP filter of the rendered chain (the decision's ext_proc is replaced by its cheapest
    stand-in instead: Envoy's set_metadata filter naming the pool's cluster, so the request is routed
    and nothing is decided, reserved or settled);
  - each access log (the stdout line, the settlement stream to ext_proc);
  - each decision stage the others do not need (llmgw/bench/ablated_extproc.py leaves it out).
Each variant and the bare Envoy alternate round by round at the same concurrency; a row is a variant's
figures and, against the full gateway's row, what the piece costs: CPU per request by process,
wake-ups per request and p50. The stages every other one needs (identity, intake, route, plan) cannot
be taken out: their in-place time (wall, per decision) comes from the full gateway's worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from extproc.config import Snapshot
from extproc.names import METADATA_NAMESPACE, POOL_CLUSTER_PREFIX, Filter, Key
from llmgw.bench.kit import POOL_ROUTE, WRK_LUA, Beside, report, wrk_missing
from llmgw.bench.kit import measured_wrk as _measured
from llmgw.local.procs import Child, wakeups
from llmgw.local.stack import Stack, StackOptions, gateway_processes
from llmgw.render.bootstrap import RenderOptions, render_bootstrap
from llmgw.render.common import pack

# The stages a variant may leave out: the rest of the decision runs without each of them.
OPTIONAL_STAGES = ("budget", "redact", "admission", "deadline", "retry", "pick")
# The rest, timed in place: each later stage needs what they set (the caller, the request, the route and
# its bound, the plan).
NEEDED_STAGES = ("identity", "intake", "authorize", "size", "route", "plan")

Edit = Callable[[bootstrap_pb2.Bootstrap], None]


@dataclass(frozen=True)
class Variant:
    name: str
    what: str  # "filter", "access log", "stage", or "" (the full gateway)
    edit: Edit | None = None
    env: tuple[tuple[str, str], ...] = ()  # for the ablated worker (llmgw/bench/ablated_extproc.py)
    module: str = "llmgw.bench.ablated_extproc"  # what runs in place of each ext_proc worker


# The floor: every worker replaced by a minimal grpc.aio server's constant reply (llmgw/bench/floor_extproc.py).
FLOOR = Variant("the worker -> a minimal grpc.aio server's constant reply (the floor)", "stage",
                module="llmgw.bench.floor_extproc")


def _hcm(boot: bootstrap_pb2.Bootstrap) -> tuple[Any, hcm_pb2.HttpConnectionManager]:
    """The gateway listener's connection manager, decoded (`_editing` packs it back)."""
    f = boot.static_resources.listeners[0].filter_chains[0].filters[0]
    hcm = hcm_pb2.HttpConnectionManager()
    f.typed_config.Unpack(hcm)
    return f, hcm


def _editing(change: Callable[[hcm_pb2.HttpConnectionManager], None]) -> Edit:
    def edit(boot: bootstrap_pb2.Bootstrap) -> None:
        f, hcm = _hcm(boot)
        change(hcm)
        f.typed_config.Pack(hcm)
    return edit


def _replace(field: Any, items: list[Any]) -> None:
    del field[:]
    field.extend(items)


def without_filter(name: str) -> Edit:
    return _editing(lambda hcm: _replace(hcm.http_filters, [h for h in hcm.http_filters if h.name != name]))


def without_access_log(name: str) -> Edit:
    return _editing(lambda hcm: _replace(hcm.access_log, [a for a in hcm.access_log if a.name != name]))


def decision_stand_in(cluster: str) -> Edit:
    """The decision's ext_proc replaced by a Lua filter that names the cluster and has the route matched
    again: routed, nothing decided, reserved or settled."""
    lua = (f'function envoy_on_request(h) h:streamInfo():dynamicMetadata():set("{METADATA_NAMESPACE}", '
           f'"{Key.CLUSTER}", "{cluster}") h:clearRouteCache() end')
    stand_in = hcm_pb2.HttpFilter(name="llmgw.bench.decision_stand_in", typed_config=pack(
        lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=lua))))
    return _editing(lambda hcm: _replace(hcm.http_filters, [stand_in if h.name == Filter.EXT_PROC else h
                                                             for h in hcm.http_filters]))


def variants(boot: bootstrap_pb2.Bootstrap, cluster: str) -> list[Variant]:
    _, hcm = _hcm(boot)
    out: list[Variant] = []
    out.append(Variant("the decision -> a Lua filter naming the pool (no ext_proc)", "filter",
                       decision_stand_in(cluster)))
    out.append(Variant("the decision -> its first reply, repeated (the round trip alone)", "stage",
                       env=(("LLMGW_ABLATE_FIXED_REPLY", "1"),)))
    out.append(FLOOR)
    out += [Variant(f"- {h.name}" + (" (off by default, on per route)" if h.disabled else ""), "filter",
                    without_filter(h.name))
            for h in hcm.http_filters if h.name not in (Filter.EXT_PROC, Filter.ROUTER)]
    out += [Variant(f"- {a.name}", "access log", without_access_log(a.name)) for a in hcm.access_log]
    out += [Variant(f"- stage {s}", "stage", env=(("LLMGW_ABLATE_STAGES", s),)) for s in OPTIONAL_STAGES]
    out.append(Variant("- slices (every request reserves in the store, and waits)", "stage",
                       env=(("LLMGW_ABLATE_NO_SLICES", "1"),)))
    return out


def chosen_variants(snap: Snapshot, render: RenderOptions, only: str | None,
                    extra: Sequence[Variant] = ()) -> list[Variant]:
    """The variants of the full gateway's configuration (and `extra`), those whose names hold one of
    `only`'s comma-separated substrings when it is given."""
    pool = snap.deployments[snap.routes[POOL_ROUTE].candidates[0].deployment_name].pool
    assert pool is not None, f"{POOL_ROUTE}'s first candidate is not a pool's"
    chosen = [*variants(render_bootstrap(snap, render), POOL_CLUSTER_PREFIX + pool), *extra]
    return [v for v in chosen if any(o in v.name for o in only.split(","))] if only else chosen


def with_variant(opts: StackOptions, v: Variant | None) -> StackOptions:
    """A gateway's options run through the ablated worker, with the variant's piece taken out (none:
    the full gateway)."""
    opts.extproc_module = v.module if v else Variant.module
    opts.extproc_env = dict(v.env if v else ())
    opts.bootstrap_edit = v.edit if v else None
    return opts


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


@dataclass
class Measured:
    """One condition's figures over a variant's rounds: medians of p50 and rate; CPU (us) and wake-ups
    per request by process kind, over every round."""
    p50_ms: float
    rps: float
    cpu_us: dict[str, float]
    wakeups: dict[str, float]
    non_2xx: int

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_us.values())


@dataclass
class Row:
    variant: Variant
    bare: Measured
    full: Measured
    ablated: Measured


class Condition:
    """A proxy wrk drives, and its processes whose counters are read around each round."""

    def __init__(self, url: str, procs: dict[str, list[Child]]):
        self.url, self.procs = url, procs
        self.p50: list[float] = []
        self.rps: list[float] = []
        self.cpu: dict[str, float] = {}
        self.woken: dict[str, float] = {}
        self.served = 0.0
        self.non_2xx = 0

    def round(self, script: Path, concurrency: int, duration: float) -> None:
        before = wakeups(self.procs)
        r, spent, n = _measured(self.url, script, concurrency, duration, self.procs)
        for kind, k in wakeups(self.procs).items():
            self.woken[kind] = self.woken.get(kind, 0.0) + k - before.get(kind, 0.0)
        for kind, sec in spent.items():
            self.cpu[kind] = self.cpu.get(kind, 0.0) + sec
        self.p50.append(r.p50_ms)
        self.rps.append(r.rps)
        self.served += n
        self.non_2xx += r.non_2xx

    def result(self) -> Measured:
        n = max(self.served, 1.0)
        return Measured(_med(self.p50), _med(self.rps), {k: v * 1e6 / n for k, v in self.cpu.items()},
                        {k: v / n for k, v in self.woken.items()}, self.non_2xx)


def measure(conditions: list[Condition], script: Path, concurrency: int, rounds: int, duration: float) -> None:
    """Rounds in which every condition runs once, the order rotated each round so none always follows
    another; a warm-up for each first."""
    for c in conditions:
        _measured(c.url, script, concurrency, 1, c.procs)
    for i in range(rounds):
        for c in conditions[i % len(conditions):] + conditions[:i % len(conditions)]:
            c.round(script, concurrency, duration)


def run_ablate(args: argparse.Namespace) -> int:
    if wrk_missing():
        return 2
    beside = Beside.start(Path(args.config), "llmgw-ablate-")
    work, snap = beside.work, beside.snap
    doc: dict[str, Any] = {"model": POOL_ROUTE, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]}
    if args.stream:
        doc["stream"] = True
    script = work / "req.lua"
    script.write_text(WRK_LUA.format(body=json.dumps(doc), key=beside.keys["acme"]))
    rows: list[Row] = []
    times = work / "times-full.json"
    full = _stack(beside, work / "full", args, None, times)
    try:
        full.start()
        for i, v in enumerate(chosen_variants(snap, full.render, args.only)):
            stack = _stack(beside, work / f"gw-{i}", args, v)
            conditions = [Condition(beside.bare_url, {"envoy": [beside.bare]}),
                          Condition(f"{full.url}/v1/chat/completions", gateway_processes(full))]
            try:
                stack.start()
                conditions.append(Condition(f"{stack.url}/v1/chat/completions", gateway_processes(stack)))
                measure(conditions, script, args.concurrency, args.rounds, args.duration)
            finally:
                stack.stop()
            rows.append(Row(v, *(c.result() for c in conditions)))
            print(_line(rows[-1]), flush=True)
    finally:
        full.stop()
        beside.stop()
    t: dict[str, Any] = json.loads(times.read_text()) if times.exists() else {"decisions": 0, "stage_us": {}}
    stage_us = {k: us / max(1, t["decisions"]) for k, us in t["stage_us"].items()}
    return report(_table(rows, stage_us, args), args.output)


def _stack(beside: Beside, state: Path, args: argparse.Namespace, v: Variant | None,
           times: Path | None = None) -> Stack:
    opts = with_variant(beside.gateway_options(state, args.workers), v)
    if times:
        opts.extproc_env["LLMGW_ABLATE_TIMES"] = str(times)
    return Stack(opts)


def _split(m: Measured) -> str:
    return " / ".join(f"{m.cpu_us.get(k, 0):.0f}" for k in ("envoy", "ext_proc", "store"))


def _line(row: Row) -> str:
    """The variant's own figures, then what the piece costs: the full gateway's less the variant's, both
    measured in the same rounds."""
    b, f, a = row.bare, row.full, row.ablated
    piece = Measured(f.p50_ms - a.p50_ms, 0.0, {k: f.cpu_us.get(k, 0.0) - a.cpu_us.get(k, 0.0)
                                                for k in ("envoy", "ext_proc", "store")},
                     {}, 0)
    head = (f"| {row.variant.name} | +{a.p50_ms - b.p50_ms:.3f} | {_split(a)} | {a.cpu_total / b.cpu_total:.1f}x "
            f"| {sum(a.wakeups.values()):.1f} | {a.rps / b.rps:.1%} ")
    if a.non_2xx:  # answers fail without it: what it costs is not measured by its absence
        return head + (f"| needed: without it, {a.non_2xx} answers were not 2xx | | | | "
                       f"| {f.cpu_total / b.cpu_total:.1f}x | {a.non_2xx} |")
    return (head + f"| {_split(piece)} | {piece.cpu_total:+.0f} "
            f"| {piece.cpu_total / b.cpu_total:+.1f}x | {piece.p50_ms:+.3f} "
            f"| {sum(f.wakeups.values()) - sum(a.wakeups.values()):+.1f} "
            f"| {f.cpu_total / b.cpu_total:.1f}x | {a.non_2xx} |")


def _table(rows: list[Row], stage_us: dict[str, float], args: argparse.Namespace) -> str:
    head = ("| without | added p50 ms | CPU us/req (Envoy / ext_proc / store) | /bare CPU | wake-ups/req "
            "| /bare req/s | the piece's CPU us/req (Envoy / ext_proc / store) | the piece's CPU us/req "
            "| in bare Envoys | the piece's p50 ms | the piece's wake-ups | full gateway /bare CPU, same rounds "
            "| non-2xx |")
    lines = [head, "|" + "---|" * 13, *(_line(r) for r in rows)]
    if rows:
        b, f = rows[0].bare, rows[0].full
        lines.insert(2, f"| (nothing: the full gateway, first variant's rounds) | +{f.p50_ms - b.p50_ms:.3f} "
                        f"| {_split(f)} "
                        f"| {f.cpu_total / b.cpu_total:.1f}x | {sum(f.wakeups.values()):.1f} | {f.rps / b.rps:.1%} "
                        f"| - | - | - | - | - | - | {f.non_2xx} |")
        lines.insert(3, f"| (bare Envoy, the same rounds) | - | {b.cpu_total:.0f} / 0 / 0 | 1.0x "
                        f"| {sum(b.wakeups.values()):.1f} | 100% | - | - | - | - | - | - | {b.non_2xx} |")
    order = [s for s in (*NEEDED_STAGES, *OPTIONAL_STAGES) if s in stage_us]
    if order:
        lines += ["", "Each stage in place, in the full gateway's worker (wall time per decision, awaits included):",
                  "", "| " + " | ".join(order) + " | all stages |", "|" + "---|" * (len(order) + 1),
                  "| " + " | ".join(f"{stage_us[s]:.0f} us" for s in order) + f" | {sum(stage_us.values()):.0f} us |"]
    body = "stream" if args.stream else "JSON"
    lines.append(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {body} requests, concurrency "
                 f"{args.concurrency}; ext_proc workers: {args.workers}; per variant {args.rounds} rounds of "
                 f"{args.duration:.0f} s in which bare Envoy, the full gateway and the variant each run once "
                 "(order rotated); medians of rounds for p50 and rates, CPU and wake-ups over all rounds.")
    return "\n".join(lines) + "\n"


def register(bsub: Any) -> None:
    a = bsub.add_parser("ablate", help="each filter, access log and decision stage taken out in turn")
    a.add_argument("--config", default="policy")
    a.add_argument("--concurrency", type=int, default=1)
    a.add_argument("--duration", type=float, default=4.0, help="seconds per round and condition")
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--workers", type=int, default=1)
    a.add_argument("--stream", action="store_true", help="stream requests (the SSE answer) instead of JSON")
    a.add_argument("--only", help="comma-separated substrings: only the variants whose names hold one")
    a.add_argument("--output", help="also write the markdown table here")
    a.set_defaults(func=run_ablate)
