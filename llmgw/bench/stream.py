"""`llmgw bench stream`: what a streamed token costs through the gateway, beside bare Envoy, one run.

An upstream that streams like vLLM, one SSE event per token at a fixed inter-token gap (so the
engine's own timing is the same in both conditions), answers both a bare Envoy proxy and the
gateway (`llmgw envoy render` of the policy, ext_proc, Valkey: the whole pipeline). Streams go to
the two in alternating rounds. Per condition: time to first token and time per output token as the
client sees them (docs/BENCHMARKS.md: TTFT to the first content event; TPOT over the rest), and the
CPU time (user + system, from /proc) each process spent per token received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.config import load_snapshot
from llmgw.bench.kit import METRICS, POOL_ROUTE, bare_bootstrap, demo_policy, report, start_envoy, without_quotas
from llmgw.local.procs import Child, cpu_seconds, free_port, http_ok, wait_until
from llmgw.local.stack import Stack, StackOptions, gateway_processes


def serve_upstream(port: int, tokens: int, gap_ms: float) -> None:
    """The fixed-gap engine: vLLM's chunk shape, a usage chunk when asked, [DONE]."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
        start = time.monotonic()
        for i in range(tokens):
            # On a fixed schedule from the start, so a late wake-up does not stretch the stream.
            await asyncio.sleep(max(0.0, start + i * gap_ms / 1000 - time.monotonic()))
            last = i == tokens - 1
            await send({**base, "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "logprobs": None,
                                             "finish_reason": "length" if last else None}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({**base, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": tokens,
                                                         "total_tokens": 12 + tokens}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


@dataclass
class StreamRun:
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0


async def _one(session: Any, url: str, body: bytes, headers: dict[str, str], run: StreamRun) -> None:
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                run.failed += 1
                await resp.read()
                return
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                now = time.perf_counter()
                stamps += [now for e in events if b'"content":"' in e and b'"content":""' not in e]
    except OSError:
        run.failed += 1
        return
    if len(stamps) < 2:
        run.failed += 1
        return
    run.tokens += len(stamps)
    run.ttft_ms.append((stamps[0] - t0) * 1000)
    run.tpot_ms.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000)


async def _streams(url: str, body: bytes, headers: dict[str, str], count: int, concurrency: int) -> StreamRun:
    import aiohttp

    run = StreamRun()
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def guarded() -> None:
            async with gate:
                await _one(session, url, body, headers, run)
        await asyncio.gather(*(guarded() for _ in range(count)))
    return run


def _pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs or [0.0])[0]


def run_stream_bench(args: argparse.Namespace) -> int:
    return report(measure_token_streams(args), args.output)


def measure_token_streams(args: argparse.Namespace) -> str:
    """Both proxies in alternating rounds: the markdown table of the figures."""
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-stream-"))
    up_port, bare_port, bare_admin = free_port(), free_port(), free_port()
    config, keys = demo_policy(Path(args.config), work / "policy")
    without_quotas(config)
    snap = load_snapshot(config)
    upstream = Child("upstream", [sys.executable, "-m", "llmgw.bench.stream", "--serve", str(up_port),
                                  "--tokens", str(args.tokens), "--gap-ms", str(args.gap_ms)],
                     work / "upstream.log").start()
    wait_until(lambda: http_ok(f"http://127.0.0.1:{up_port}/health"), 30, "upstream", upstream)
    bare = start_envoy("bare", bare_bootstrap(bare_port, bare_admin, up_port), work, bare_admin)
    opts = StackOptions.on_free_ports(config, work / "gw", snap, workers=args.workers,
                                      start_engines=False, envoy_concurrency=1)
    opts.engine_ports = {p: (up_port,) for p in snap.gateway.pools}
    stack = Stack(opts)
    body = json.dumps({"model": POOL_ROUTE, "max_tokens": args.tokens, "stream": True,
                       "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]}).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {keys['acme']}"}
    runs: dict[str, StreamRun] = {"bare": StreamRun(), "gateway": StreamRun()}
    cpu: dict[str, dict[str, float]] = {"bare": {}, "gateway": {}}
    try:
        stack.start()
        urls = {"bare": f"http://127.0.0.1:{bare_port}/v1/chat/completions",
                "gateway": f"{stack.url}/v1/chat/completions"}
        procs = {"bare": {"envoy": [bare]}, "gateway": gateway_processes(stack)}
        for name in urls:  # warm-up
            asyncio.run(_streams(urls[name], body, headers, args.concurrency, args.concurrency))
        for _ in range(args.rounds):
            for name, url in urls.items():
                before = cpu_seconds(procs[name])
                got = asyncio.run(_streams(url, body, headers, args.streams // args.rounds, args.concurrency))
                for proc, sec in cpu_seconds(procs[name]).items():
                    cpu[name][proc] = cpu[name].get(proc, 0.0) + sec - before.get(proc, 0.0)
                run = runs[name]
                run.ttft_ms += got.ttft_ms
                run.tpot_ms += got.tpot_ms
                run.tokens += got.tokens
                run.failed += got.failed
    finally:
        stack.stop()
        bare.stop()
        upstream.stop()
    return _table(runs, cpu, args)


def _table(runs: dict[str, StreamRun], cpu: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    per_token = {name: {proc: sec / max(1, runs[name].tokens) * 1e6 for proc, sec in procs.items()}
                 for name, procs in cpu.items()}
    bare_total = sum(per_token["bare"].values())
    gw_total = sum(per_token["gateway"].values())
    b, g = runs["bare"], runs["gateway"]
    lines = [
        "| proxy | streams | tokens | failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| Envoy us/token | ext_proc us/token | store us/token | total us/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        pt = per_token[name]
        lines.append(
            f"| {name} | {len(run.ttft_ms)} | {run.tokens} | {run.failed} | {_pct(run.ttft_ms, 50):.2f} "
            f"| {_pct(run.ttft_ms, 99):.2f} | {_pct(run.tpot_ms, 50):.3f} | {_pct(run.tpot_ms, 99):.3f} "
            f"| {pt.get('envoy', 0.0):.1f} | {pt.get('ext_proc', 0.0):.1f} | {pt.get('store', 0.0):.1f} "
            f"| {sum(pt.values()):.1f} |")
    ttft_added = _pct(g.ttft_ms, 50) - _pct(b.ttft_ms, 50)
    tpot_added = (_pct(g.tpot_ms, 50) / _pct(b.tpot_ms, 50) - 1) * 100 if b.tpot_ms else 0.0
    lines += [
        "",
        f"Gateway CPU per token / bare Envoy's: {gw_total / bare_total:.2f}x "
        f"({gw_total:.1f} vs {bare_total:.1f} us). TTFT added (p50): {ttft_added:+.2f} ms. "
        f"TPOT added (p50): {tpot_added:+.2f}%.",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.streams} streams per proxy of {args.tokens} "
        f"tokens, one event each, {args.gap_ms} ms apart, {args.concurrency} at a time; {args.rounds} alternating "
        f"rounds; ext_proc workers: {args.workers}; Envoy --concurrency 1.",
    ]
    return "\n".join(lines) + "\n"


def register(bsub: Any) -> None:
    b = bsub.add_parser("stream", help="CPU per streamed token and TTFT/TPOT added, beside bare Envoy, one run")
    b.add_argument("--config", default="policy")
    b.add_argument("--streams", type=int, default=48, help="streams per proxy, over all rounds")
    b.add_argument("--tokens", type=int, default=256, help="tokens per stream (one SSE event each)")
    b.add_argument("--gap-ms", type=float, default=10.0, help="the upstream's inter-token gap")
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--workers", type=int, default=1, help="ext_proc worker processes")
    b.add_argument("--output")
    b.set_defaults(func=run_stream_bench)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m llmgw.bench.stream")
    p.add_argument("--serve", type=int, required=True)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--gap-ms", type=float, default=10.0)
    a = p.parse_args()
    serve_upstream(a.serve, a.tokens, a.gap_ms)


if __name__ == "__main__":
    main()
