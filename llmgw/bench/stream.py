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

from extproc.config import Snapshot, load_snapshot
from llmgw.bench.ablate import FLOOR, Variant, chosen_variants, with_variant
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
    if getattr(args, "ablate", False):
        return report(ablate_token_streams(args), args.output)
    return report(measure_token_streams(args), args.output)


@dataclass
class Streamed:
    """One proxy the streams go to, and its processes whose CPU is read around each round."""

    url: str
    procs: dict[str, list[Child]]
    run: StreamRun = field(default_factory=StreamRun)
    cpu: dict[str, float] = field(default_factory=dict)

    def round(self, body: bytes, headers: dict[str, str], streams: int, concurrency: int) -> None:
        before = cpu_seconds(self.procs)
        got = asyncio.run(_streams(self.url, body, headers, streams, concurrency))
        for proc, sec in cpu_seconds(self.procs).items():
            self.cpu[proc] = self.cpu.get(proc, 0.0) + sec - before.get(proc, 0.0)
        self.run.ttft_ms += got.ttft_ms
        self.run.tpot_ms += got.tpot_ms
        self.run.tokens += got.tokens
        self.run.failed += got.failed

    def per_token_us(self) -> dict[str, float]:
        return {proc: sec / max(1, self.run.tokens) * 1e6 for proc, sec in self.cpu.items()}


def _rounds(proxies: list[Streamed], body: bytes, headers: dict[str, str], args: argparse.Namespace) -> None:
    """A warm-up for each, then rounds in which each proxy gets its share of the streams in turn (the
    order rotated each round, so none always follows another)."""
    for p in proxies:
        asyncio.run(_streams(p.url, body, headers, args.concurrency, args.concurrency))
    for i in range(args.rounds):
        for p in proxies[i % len(proxies):] + proxies[:i % len(proxies)]:
            p.round(body, headers, args.streams // args.rounds, args.concurrency)


@dataclass
class _Setup:
    """The fixed-gap upstream, a bare Envoy in front of it, and what a gateway on it is started from."""

    work: Path
    config: Path
    snap: Snapshot
    keys: dict[str, str]
    upstream: Child
    up_port: int
    bare: Child
    bare_url: str

    @classmethod
    def start(cls, args: argparse.Namespace) -> _Setup:
        work = Path(tempfile.mkdtemp(prefix="llmgw-bench-stream-"))
        up_port, bare_port, bare_admin = free_port(), free_port(), free_port()
        config, keys = demo_policy(Path(args.config), work / "policy")
        without_quotas(config)
        upstream = Child("upstream", [sys.executable, "-m", "llmgw.bench.stream", "--serve", str(up_port),
                                      "--tokens", str(args.tokens), "--gap-ms", str(args.gap_ms)],
                         work / "upstream.log").start()
        try:
            wait_until(lambda: http_ok(f"http://127.0.0.1:{up_port}/health"), 30, "upstream", upstream)
            bare = start_envoy("bare", bare_bootstrap(bare_port, bare_admin, up_port), work, bare_admin)
        except BaseException:
            upstream.stop()
            raise
        return cls(work, config, load_snapshot(config), keys, upstream, up_port, bare,
                   f"http://127.0.0.1:{bare_port}/v1/chat/completions")

    def gateway(self, name: str, args: argparse.Namespace, variant: Variant | None = None) -> Stack:
        opts = StackOptions.on_free_ports(self.config, self.work / name, self.snap, workers=args.workers,
                                          start_engines=False, envoy_concurrency=1)
        opts.engine_ports = {p: (self.up_port,) for p in self.snap.gateway.pools}
        return Stack(with_variant(opts, variant) if variant is not None else opts)

    def request(self, args: argparse.Namespace) -> tuple[bytes, dict[str, str]]:
        body = json.dumps({"model": POOL_ROUTE, "max_tokens": args.tokens, "stream": True,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
        return body.encode(), {"content-type": "application/json", "authorization": f"Bearer {self.keys['acme']}"}

    def stop(self) -> None:
        self.bare.stop()
        self.upstream.stop()


def measure_token_streams(args: argparse.Namespace) -> str:
    """The proxies in alternating rounds - bare Envoy, the gateway and (unless `--no-floor`) the floor,
    the gateway's Envoy with a minimal ext_proc server: the markdown table of the figures."""
    setup = _Setup.start(args)
    stacks = {"gateway": setup.gateway("gw", args)}
    if getattr(args, "floor", True):
        stacks["floor"] = setup.gateway("floor", args, FLOOR)
    body, headers = setup.request(args)
    try:
        proxies = {"bare": Streamed(setup.bare_url, {"envoy": [setup.bare]})}
        for name, stack in stacks.items():
            stack.start()
            proxies[name] = Streamed(f"{stack.url}/v1/chat/completions", gateway_processes(stack))
        _rounds(list(proxies.values()), body, headers, args)
    finally:
        for stack in stacks.values():
            stack.stop()
        setup.stop()
    return _table({n: p.run for n, p in proxies.items()}, {n: p.cpu for n, p in proxies.items()}, args)


def ablate_token_streams(args: argparse.Namespace) -> str:
    """Per streamed token, what each piece costs: for each variant of `llmgw bench ablate` (a filter, an
    access log or a decision stage taken out; the engine picker's scraping slowed to its idle pace),
    rounds of bare Envoy, the full gateway and the variant, and the full gateway's CPU per token less
    the variant's."""
    setup = _Setup.start(args)
    full = setup.gateway("full", args)
    body, headers = setup.request(args)
    lines = ["| without | CPU us/token (Envoy / ext_proc / store) | /bare | the piece's us/token "
             "(Envoy / ext_proc / store) | the piece's us/token | full gateway /bare, same rounds | failed |",
             "|---|---|---|---|---|---|---|"]
    try:
        full.start()
        slower_scrapes = Variant("the picker scraping at its idle pace (1 s)", "stage",
                                 env=(("LLMGW_ABLATE_SCRAPE_S", "1.0"),))
        for i, v in enumerate(chosen_variants(setup.snap, full.render, args.only, (slower_scrapes,))):
            stack = setup.gateway(f"gw-{i}", args, v)
            try:
                stack.start()
                proxies = [Streamed(setup.bare_url, {"envoy": [setup.bare]}),
                           Streamed(f"{full.url}/v1/chat/completions", gateway_processes(full)),
                           Streamed(f"{stack.url}/v1/chat/completions", gateway_processes(stack))]
                _rounds(proxies, body, headers, args)
            finally:
                stack.stop()
            bare, whole, ablated = (p.per_token_us() for p in proxies)
            lines.append(ablation_row(v.name, bare, whole, ablated, proxies[2].run.failed))
            print(lines[-1], flush=True)
    finally:
        full.stop()
        setup.stop()
    lines.append(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; per variant {args.rounds} rounds in "
                 f"which bare Envoy, the full gateway and the variant each get {args.streams // args.rounds} "
                 f"streams of {args.tokens} tokens ({args.gap_ms} ms apart, {args.concurrency} at a time), the "
                 "order rotated; CPU from /proc over all rounds.")
    return "\n".join(lines) + "\n"


def ablation_row(name: str, bare: dict[str, float], full: dict[str, float], ablated: dict[str, float],
                 failed: int) -> str:
    """A variant's row: its CPU per token by process and against bare, and the piece's (the full
    gateway's less the variant's, from the same rounds); a variant whose streams failed names the
    piece as needed, its cost not measured by its absence."""
    ratio = f"{sum(full.values()) / sum(bare.values()):.2f}x"
    if failed:
        return f"| {name} | needed: without it, {failed} streams failed | | | | | {ratio} | {failed} |"
    piece = {k: full.get(k, 0.0) - ablated.get(k, 0.0) for k in ("envoy", "ext_proc", "store")}
    return (f"| {name} | {_split(ablated)} | {sum(ablated.values()) / sum(bare.values()):.2f}x | {_split(piece)} "
            f"| {sum(piece.values()):+.1f} | {ratio} | 0 |")


def _split(us: dict[str, float]) -> str:
    return " / ".join(f"{us.get(k, 0.0):.1f}" for k in ("envoy", "ext_proc", "store"))


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
        f"TPOT added (p50): {tpot_added:+.2f}%."
        + (f" The floor's CPU per token / bare Envoy's: {sum(per_token['floor'].values()) / bare_total:.2f}x."
           if "floor" in per_token else ""),
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
    b.add_argument("--ablate", action="store_true",
                   help="price each piece per token: every variant of `bench ablate` in turn beside the full gateway")
    b.add_argument("--only", help="with --ablate: only the variants whose names hold one of these substrings")
    b.add_argument("--no-floor", dest="floor", action="store_false",
                   help="leave out the floor (the gateway's Envoy with a minimal ext_proc server)")
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
