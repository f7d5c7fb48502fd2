"""`llmgw bench overhead`: what the gateway adds over bare Envoy, measured in one run.

Envoys on loopback, one configuration style:
  upstream  answers every chat completion itself (direct response: JSON, or SSE for stream=true),
            so the upstream costs the same microseconds in every condition;
  bare      a plain proxy to that upstream: the baseline;
  gateway   `llmgw envoy render` output with the pool pointed at the same upstream, plus ext_proc;
  floor     the same rendered Envoy with a minimal grpc.aio ext_proc server in place of the workers,
            answering every decision with a constant (llmgw/bench/floor_extproc.py): what the design
            (Envoy, this filter configuration, Python gRPC) costs before the gateway decides anything;
  LiteLLM   the peer's proxy to the same upstream.
wrk drives every condition with the same request, alternating between them round by round so that
drift on the shared 2-core machine hits all alike. Figures: p50 latency, requests/s, CPU and wake-ups
per request from /proc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from llmgw.bench.ablate import FLOOR, with_variant
from llmgw.bench.kit import (
    BENCH_TOOL,
    LITELLM,
    LITELLM_KEY,
    POOL_ROUTE,
    WRK_LUA,
    Beside,
    Result,
    litellm_proxy,
    report,
    run_wrk,
    wrk_missing,
)
from llmgw.local.procs import Child, cpu_seconds, wakeups
from llmgw.local.stack import Stack, gateway_processes


def run_overhead(args: argparse.Namespace) -> int:
    if wrk_missing():
        return 2
    beside = Beside.start(Path(args.config), "llmgw-bench-")
    work, keys, snap, up_port = beside.work, beside.keys, beside.snap, beside.up_port
    children = [beside.upstream, beside.bare]
    stack = Stack(beside.gateway_options(work / "gw", args.workers))
    floor = Stack(with_variant(beside.gateway_options(work / "floor", args.workers), FLOOR)) if args.floor else None
    rows: list[str] = []
    try:
        stack.start()
        urls = {"bare": beside.bare_url,
                "gateway": f"{stack.url}/v1/chat/completions"}
        procs: dict[str, dict[str, list[Child]]] = {"bare": {"envoy": [children[1]]},
                                                     "gateway": gateway_processes(stack)}
        if floor is not None:
            floor.start()
            urls["floor"] = f"{floor.url}/v1/chat/completions"
            procs["floor"] = gateway_processes(floor)
        if args.litellm:
            peer, port = litellm_proxy(work, up_port, list(snap.routes), Path(args.litellm_venv))
            children.append(peer)
            urls["litellm"] = f"http://127.0.0.1:{port}/v1/chat/completions"
            procs["litellm"] = {"litellm": [peer]}
        key = keys["acme"]
        body = json.dumps({"model": POOL_ROUTE, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
        # `--checked`: also a request offering a tool, whose answer (a call of it) the gateway checks.
        for stream, tools in ((False, False), (True, False), *(((False, True), (True, True)) if args.checked else ())):
            scripts = {}
            for name in urls:
                doc = {**json.loads(body), **({"stream": True} if stream else {}),
                       **({"tools": [BENCH_TOOL]} if tools else {})}
                scripts[name] = work / f"req-{name}-{stream}-{tools}.lua"
                scripts[name].write_text(WRK_LUA.format(body=json.dumps(doc),
                                                        key=LITELLM_KEY if name == "litellm" else key))
            for c in (int(x) for x in args.concurrency.split(",")):
                got: dict[str, list[Result]] = {name: [] for name in urls}
                cpu: dict[str, dict[str, float]] = {name: {} for name in urls}
                woken: dict[str, dict[str, float]] = {name: {} for name in urls}
                for name, url in urls.items():
                    run_wrk(url, scripts[name], c, 2)  # warm-up
                for _ in range(args.rounds):
                    for name, url in urls.items():
                        before, switches = cpu_seconds(procs[name]), wakeups(procs[name])
                        got[name].append(run_wrk(url, scripts[name], c, args.duration / args.rounds))
                        for proc, sec in cpu_seconds(procs[name]).items():
                            cpu[name][proc] = cpu[name].get(proc, 0.0) + sec - before.get(proc, 0.0)
                        for proc, n in wakeups(procs[name]).items():
                            woken[name][proc] = woken[name].get(proc, 0.0) + n - switches.get(proc, 0)
                secs = max(1, round(args.duration / args.rounds))  # what run_wrk runs for
                rows.append(_row(("stream" if stream else "json") + (", tools" if tools else ""), c, got, cpu, secs,
                                 woken))
                print(rows[-1], flush=True)
        picked = _picked_share(stack.logs / "envoy.log", f"127.0.0.1:{up_port}")
    finally:
        stack.stop()
        if floor is not None:
            floor.stop()
        for ch in children:
            ch.stop()
    table = _table(rows, args) + f"Endpoint picker named the engine on {picked:.0%} of the gateway's requests.\n"
    if args.token_streams:
        from llmgw.bench.stream import measure_token_streams

        table += "\nStreams of one event per token (`llmgw bench stream`, defaults):\n\n"
        table += measure_token_streams(argparse.Namespace(
            config=args.config, streams=48, tokens=256, gap_ms=10.0, concurrency=8, rounds=3, workers=args.workers,
            output=None, floor=args.floor))
    return report(table, args.output)


def _picked_share(envoy_log: Path, engine: str) -> float:
    """Share of access-log lines in which the picker's order named the engine (it scored it)."""
    lines = [json.loads(ln) for ln in envoy_log.read_text().splitlines() if ln.startswith("{")]
    return sum(1 for ln in lines if ln.get("picked") == engine) / max(1, len(lines))


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _row(kind: str, c: int, got: dict[str, list[Result]], cpu: dict[str, dict[str, float]], secs: int,
         woken: dict[str, dict[str, float]]) -> str:
    """Medians of the rounds; CPU (us) and wake-ups (context switches) per request from each
    process's counters over the requests served."""
    bare, gw = got["bare"], got["gateway"]
    b50, g50 = _med([r.p50_ms for r in bare]), _med([r.p50_ms for r in gw])
    brps, grps = _med([r.rps for r in bare]), _med([r.rps for r in gw])
    errors = sum(r.non_2xx for r in bare + gw)

    def per_request(counters: dict[str, dict[str, float]], name: str) -> dict[str, float]:
        served = max(1.0, sum(r.rps * secs for r in got[name]))
        return {proc: n / served for proc, n in counters[name].items()}
    gcpu = {proc: s * 1e6 for proc, s in per_request(cpu, "gateway").items()}
    bcpu = {proc: s * 1e6 for proc, s in per_request(cpu, "bare").items()}
    gwake, bwake = per_request(woken, "gateway"), sum(per_request(woken, "bare").values())
    row = (f"| {kind} | {c} | {b50:.3f} | {g50:.3f} | +{g50 - b50:.3f} | {brps:,.0f} | {grps:,.0f} | {grps / brps:.1%} "
           f"| {bcpu.get('envoy', 0):.0f} | {gcpu.get('envoy', 0):.0f} / {gcpu.get('ext_proc', 0):.0f} / "
           f"{gcpu.get('store', 0):.0f} | {sum(gcpu.values()) / max(1.0, sum(bcpu.values())):.1f}x "
           f"| {bwake:.1f} | {gwake.get('envoy', 0):.1f} / {gwake.get('ext_proc', 0):.1f} / "
           f"{gwake.get('store', 0):.1f} | {errors} |")
    if "floor" in got:
        flo = got["floor"]
        f50, frps = _med([r.p50_ms for r in flo]), _med([r.rps for r in flo])
        fcpu = {proc: s * 1e6 for proc, s in per_request(cpu, "floor").items()}
        row += (f" {f50:.3f} | +{f50 - b50:.3f} | {frps:,.0f} | {fcpu.get('envoy', 0):.0f} / "
                f"{fcpu.get('ext_proc', 0):.0f} | {sum(fcpu.values()) / max(1.0, sum(bcpu.values())):.1f}x "
                f"| {sum(gcpu.values()) / max(1.0, sum(fcpu.values())):.2f}x | +{g50 - f50:.3f} "
                f"| {sum(r.non_2xx for r in flo)} |")
    if "litellm" in got:
        lit = got["litellm"]
        l50, lrps = _med([r.p50_ms for r in lit]), _med([r.rps for r in lit])
        lcpu = per_request(cpu, "litellm").get("litellm", 0.0) * 1e6
        row += (f" {l50:.3f} | +{l50 - b50:.3f} | {lrps:,.0f} | {lcpu:.0f} "
                f"| {grps / max(lrps, 1e-9):.1f}x | {sum(r.non_2xx for r in lit)} |")
    return row


def _table(rows: list[str], args: argparse.Namespace) -> str:
    head = ("| body | conc. | bare p50 ms | gw p50 ms | added p50 | bare req/s | gw req/s | gw/bare "
            "| bare CPU us/req | gw CPU us/req (Envoy / ext_proc / store) | gw/bare CPU | bare wake-ups/req "
            "| gw wake-ups/req (Envoy / ext_proc / store) | non-2xx |")
    rule = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    if args.floor:
        head += (" floor p50 ms | floor added p50 | floor req/s | floor CPU us/req (Envoy / ext_proc) "
                 "| floor/bare CPU | gw/floor CPU | gw p50 above the floor's | floor non-2xx |")
        rule += "---|---|---|---|---|---|---|---|"
    if args.litellm:
        head += (" LiteLLM p50 ms | LiteLLM added p50 | LiteLLM req/s | LiteLLM CPU us/req | gw/LiteLLM req/s "
                 "| LiteLLM non-2xx |")
        rule += "---|---|---|---|---|---|"
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ext_proc workers: {args.workers}; "
            f"{args.rounds} alternating rounds, {args.duration:.0f}s per condition and level; medians of rounds"
            + (f"; LiteLLM: {LITELLM}, one worker" if args.litellm else "") + ".\n")
    return head + "\n" + rule + "\n" + "\n".join(rows) + "\n" + note
