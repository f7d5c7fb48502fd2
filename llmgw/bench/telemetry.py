"""`llmgw bench telemetry`: what traces and metrics cost the gateway. Two gateways on one fast upstream
(an Envoy answering a fixed chat completion, as `llmgw bench overhead` uses), the same policy: one
with telemetry on (metrics observed for every settlement and attempt; every request traced, spans
exported to a JSON-lines file at 100% sampling), one with it off (`LLMGW_METRICS=off`, no exporter).
wrk in alternating rounds at concurrency 1 (p50) and 32 (throughput); ext_proc CPU per request from
/proc. Targets (issue 14): telemetry on costs <= 0.1 ms p50 at concurrency 1 and <= 10% of
throughput at concurrency 32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from extproc.config import load_snapshot
from llmgw.bench.kit import (
    POOL_ROUTE,
    WRK_LUA,
    Result,
    demo_policy,
    measured_wrk,
    report,
    run_wrk,
    start_envoy,
    upstream_bootstrap,
    without_quotas,
    wrk_missing,
)
from llmgw.local.procs import free_port
from llmgw.local.stack import Stack, StackOptions, gateway_processes

MODES = {"telemetry on": True, "telemetry off": False}


def run_telemetry_bench(args: argparse.Namespace) -> int:
    if wrk_missing():
        return 2
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-telemetry-"))
    up_port, up_admin = free_port(), free_port()
    config, keys = demo_policy(Path(args.config).resolve(), work / "policy")
    without_quotas(config)
    snap = load_snapshot(config)
    upstream = start_envoy("upstream", upstream_bootstrap(up_port, up_admin), work, up_admin)
    stacks: dict[str, Stack] = {}
    results: dict[tuple[str, int], list[Result]] = {}
    cpu: dict[tuple[str, int], float] = {}
    served: dict[tuple[str, int], float] = {}
    try:
        for name, on in MODES.items():
            opts = StackOptions.on_free_ports(config, work / name.replace(" ", "-"), snap, workers=1,
                                              start_engines=False, envoy_concurrency=1, traces=on,
                                              extproc_env={} if on else {"LLMGW_METRICS": "off"})
            opts.engine_ports = {p: (up_port,) for p in snap.gateway.pools}
            stacks[name] = Stack(opts).start()
        body = json.dumps({"model": POOL_ROUTE, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
        script = work / "chat.lua"
        script.write_text(WRK_LUA.format(body=body, key=keys["acme"]))
        urls = {name: f"{s.url}/v1/chat/completions" for name, s in stacks.items()}
        for name in MODES:
            run_wrk(urls[name], script, 4, 2)  # warm-up
        for c in (1, 32):
            for i in range(args.rounds):
                # ABBA: each mode goes first in half the rounds. Always measuring one first read it
                # ~5% slower with both gateways configured alike (an A/A run, docs/BENCHMARKS.md).
                for name in (list(MODES) if i % 2 == 0 else list(reversed(MODES))):
                    r, spent, n = measured_wrk(urls[name], script, c, args.duration / args.rounds,
                                               gateway_processes(stacks[name]))
                    results.setdefault((name, c), []).append(r)
                    cpu[(name, c)] = cpu.get((name, c), 0.0) + spent["ext_proc"]
                    served[(name, c)] = served.get((name, c), 0.0) + n
        traced = stacks["telemetry on"].traces_file
        spans = traced.read_text().count("\n") if traced.exists() else 0
    finally:
        for s in stacks.values():
            s.stop()
        upstream.stop()
    lines = ["| telemetry | concurrency | requests/s | p50 ms | p99 ms | non-2xx | ext_proc CPU us/request |",
             "|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for c in (1, 32):
        for name in MODES:
            rs = results[(name, c)]
            rps, p50 = statistics.median(r.rps for r in rs), statistics.median(r.p50_ms for r in rs)
            summary[f"{name} {c}"] = (rps, p50)
            p99 = statistics.median(r.p99_ms for r in rs)
            bad = sum(r.non_2xx for r in rs)
            lines.append(f"| {name.split()[1]} | {c} | {rps:.0f} | {p50:.3f} | {p99:.3f} | {bad} "
                         f"| {cpu[(name, c)] / max(served[(name, c)], 1) * 1e6:.0f} |")
    p50_delta = summary["telemetry on 1"][1] - summary["telemetry off 1"][1]
    ratio = summary["telemetry on 32"][0] / max(summary["telemetry off 32"][0], 1e-9)
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} ABBA-ordered rounds of "
            f"{args.duration / args.rounds:.0f}s per concurrency; one ext_proc worker, Envoy --concurrency 1; "
            f"{spans} spans written by the traced gateway.\n\nTelemetry on: p50 {p50_delta:+.3f} ms at concurrency 1 "
            f"(target <= +0.1), throughput {ratio:.2f}x of off at 32 (target >= 0.90).\n")
    return report("\n".join(lines) + "\n" + note, args.output)


def register(bsub: Any) -> None:
    b = bsub.add_parser("telemetry", help="traces and metrics on against off, same gateway and upstream")
    b.add_argument("--config", default="policy")
    b.add_argument("--duration", type=float, default=16.0)
    b.add_argument("--rounds", type=int, default=4, help="an even number: each mode goes first in half")
    b.add_argument("--output")
    b.set_defaults(func=run_telemetry_bench)
