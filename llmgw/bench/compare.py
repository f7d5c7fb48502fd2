"""`llmgw bench compare TRACE --a SPEC --b SPEC`: two configurations that differ in one mechanism,
on the same trace, repeated, reported as the difference B - A with its run-to-run spread.

A SPEC is `key=value,...`: `config=DIR` (a policy directory: a fallback candidate, a route
setting), `lb=picker|round_robin` (the endpoint picker on or off), `profile=MODEL@GPU` (the
engines' profile), `prefix_caching=on|off` (vLLM's --enable-prefix-caching). Each run starts its
own gateway (Envoy, ext_proc, Valkey, two simulated engines) on free ports, replays the trace
open-loop (llmgw/bench/openloop.py) and stops it; the runs alternate A B B A, so neither side always
goes first (an A/A run of another benchmark read the first 5% slower). A difference smaller than
its spread is reported as such: not a finding.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.config import load_snapshot
from llmgw.bench.kit import demo_policy, without_quotas
from llmgw.bench.openloop import Outcome, replay
from llmgw.bench.stats import percentile
from llmgw.bench.workload import TraceRecord, read
from llmgw.local.stack import Stack, StackOptions

KEYS = {"config", "lb", "profile", "prefix_caching"}


def parse_spec(text: str) -> dict[str, str]:
    spec = dict(part.split("=", 1) for part in filter(None, text.split(",")) if "=" in part)
    unknown = set(spec) - KEYS
    if unknown or len(spec) != len(list(filter(None, text.split(",")))):
        raise ValueError(f"{text!r}: expected key=value,... with keys {sorted(KEYS)}")
    if spec.get("lb", "picker") not in ("picker", "round_robin"):
        raise ValueError("lb: picker or round_robin")
    if spec.get("prefix_caching", "on") not in ("on", "off"):
        raise ValueError("prefix_caching: on or off")
    return spec


def metrics(outcomes: Sequence[Outcome], engines_hits: float) -> dict[str, float]:
    """What one run measured (NaN where nothing was measured)."""
    answered = [o for o in outcomes if o.e2e_s is not None]
    ttft = [o.ttft_s for o in answered if o.ttft_s is not None]
    tpot = [o.tpot_s for o in answered if o.tpot_s is not None]
    e2e = [o.e2e_s for o in answered if o.e2e_s is not None]

    def p(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000 if values else float("nan")

    return {"TTFT p50 ms": p(ttft, 50), "TTFT p95 ms": p(ttft, 95), "TPOT p50 ms": p(tpot, 50),
            "TPOT p95 ms": p(tpot, 95), "E2E p50 ms": p(e2e, 50), "E2E p95 ms": p(e2e, 95),
            "answered %": 100 * len(answered) / len(outcomes) if outcomes else float("nan"),
            "prefix cache hit %": engines_hits}


def _hit_rate(stack: Stack) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the pool's engines (vLLM's prefix cache counters)."""
    import urllib.request

    hits = queries = 0.0
    for url in stack.engine_urls():
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total{"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total{"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def run_once(spec: Mapping[str, str], trace: Sequence[TraceRecord], work: Path, speed: float,
             time_scale: float) -> dict[str, float]:
    config, keys = demo_policy(Path(spec.get("config", "policy")).resolve(), work / "policy")
    without_quotas(config)
    snap = load_snapshot(config)
    engine_args = ("--no-enable-prefix-caching",) if spec.get("prefix_caching") == "off" else ()
    opts = StackOptions.on_free_ports(config, work / "state", snap, time_scale=time_scale,
                                      engine_profile=spec.get("profile", "llama-3-8b@h100"),
                                      engine_args=engine_args, pool_lb=spec.get("lb", "picker"))
    stack = Stack(opts).start()
    try:
        outcomes = asyncio.run(replay(f"{stack.url}/v1/chat/completions", keys, trace, speed))
        hits, queries = _hit_rate(stack)
    finally:
        stack.stop()
    return metrics(outcomes, 100 * hits / queries if queries else float("nan"))


@dataclass(frozen=True)
class Row:
    metric: str
    a: float  # mean over the repeats
    b: float
    diff: float  # mean of the per-repeat differences B - A
    spread: float  # half the range of the per-repeat differences

    @property
    def finding(self) -> bool:
        return abs(self.diff) > self.spread


def compare(a_runs: Sequence[Mapping[str, float]], b_runs: Sequence[Mapping[str, float]]) -> list[Row]:
    rows = []
    for key in a_runs[0]:
        diffs = [b[key] - a[key] for a, b in zip(a_runs, b_runs, strict=True)]
        rows.append(Row(key, statistics.fmean(r[key] for r in a_runs), statistics.fmean(r[key] for r in b_runs),
                        statistics.fmean(diffs), (max(diffs) - min(diffs)) / 2))
    return rows


def render(rows: Sequence[Row], a: str, b: str, repeats: int) -> str:
    lines = [f"A: {a}", f"B: {b}", f"{repeats} repeats each, A B B A order; spread = half the range of the "
             "per-repeat differences", "", "| metric | A | B | B - A | spread | |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.metric} | {r.a:.1f} | {r.b:.1f} | {r.diff:+.1f} | {r.spread:.1f} | "
                     f"{'difference' if r.finding else 'within spread'} |")
    return "\n".join(lines) + "\n"


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        specs = {"A": parse_spec(args.a), "B": parse_spec(args.b)}
        trace = read(Path(args.trace))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    work = Path(tempfile.mkdtemp(prefix="llmgw-compare-"))
    for i in range(args.repeats):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            t0 = time.monotonic()
            runs[side].append(run_once(specs[side], trace, work / f"{side}{i}", args.speed, args.time_scale))
            print(f"repeat {i + 1} {side}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    text = render(compare(runs["A"], runs["B"]), args.a, args.b, args.repeats)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


def register(bsub: Any) -> None:
    c = bsub.add_parser("compare", help="two configurations differing in one mechanism, same trace, repeated")
    c.add_argument("trace")
    c.add_argument("--a", required=True, help="key=value,... (config, lb, profile, prefix_caching)")
    c.add_argument("--b", required=True)
    c.add_argument("--repeats", type=int, default=2)
    c.add_argument("--speed", type=float, default=1.0)
    c.add_argument("--time-scale", type=float, default=1.0, help="the simulated engines' (real s per simulated s)")
    c.add_argument("--output")
    c.set_defaults(func=cmd_compare)
