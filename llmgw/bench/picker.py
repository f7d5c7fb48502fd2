"""`llmgw bench picker`: the endpoint picker against round-robin on the simulated pool, in one run.

Trace: every demo tenant has `prefixes` long system prompts (~`prefix_tokens` tokens each) shared by
its requests, followed by a short unique question; outputs are short, so prefill dominates. The
engines' KV cache holds about half of all prefixes, so where a prefix is sent matters: round-robin
sends every prefix to every engine and the caches thrash; the picker keeps a tenant's prefix on the
engine that has it (and weighs queues and KV use).

Procedure: measure the round-robin pool's capacity with a closed loop, then drive each configuration
open-loop (Poisson arrivals) at 80% of that rate. TTFT is the engines' own (simulated seconds, from
the physical model; see docs/SIMULATOR.md), throughput and errors are the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from extproc.config import load_snapshot
from llmgw.bench.kit import demo_policy, report
from llmgw.local.stack import Stack, StackOptions

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform")


def make_prefixes(tenants: list[str], per_tenant: int, tokens: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {t: [" ".join(rng.choice(WORDS) for _ in range(tokens)) for _ in range(per_tenant)] for t in tenants}


@dataclass
class Outcome:
    ok: int = 0
    failed: int = 0
    latencies: list[float] | None = None


async def _one(session: aiohttp.ClientSession, url: str, key: str, system: str, n: int, out: Outcome) -> None:
    body = {"model": "chat-default", "max_tokens": 8,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {n}"}]}
    t0 = time.monotonic()
    try:
        async with session.post(url, json=body, headers={"authorization": f"Bearer {key}"}) as r:
            await r.read()
            if r.status == 200:
                out.ok += 1
                assert out.latencies is not None
                out.latencies.append(time.monotonic() - t0)
            else:
                out.failed += 1
    except (TimeoutError, aiohttp.ClientError):
        out.failed += 1


def _pick(rng: random.Random, prefixes: dict[str, list[str]]) -> tuple[str, str]:
    """(API key, system prompt): the prefixes are per tenant, keyed by the tenant's key."""
    key = rng.choice(sorted(prefixes))
    return key, rng.choice(prefixes[key])


async def closed_loop(url: str, prefixes: dict[str, list[str]], concurrency: int, duration: float) -> float:
    """Completed requests per second with `concurrency` clients always busy."""
    out = Outcome(latencies=[])
    rng = random.Random(1)
    deadline = time.monotonic() + duration
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                key, system = _pick(rng, prefixes)
                await _one(session, url, key, system, w * 1_000_000 + n, out)
                n += 1
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return out.ok / duration


async def open_loop(url: str, prefixes: dict[str, list[str]], rate: float, duration: float, seed: int) -> Outcome:
    out = Outcome(latencies=[])
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.monotonic()
        t, n = 0.0, 0
        while t < duration:
            t += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            key, system = _pick(rng, prefixes)
            tasks.append(asyncio.create_task(_one(session, url, key, system, n, out)))
            n += 1
        await asyncio.gather(*tasks)
    return out


def _engine_ttfts(stack: Stack, since: float) -> tuple[list[float], int, int]:
    import json
    import urllib.request

    ttfts, hits_tokens, prompt_tokens = [], 0, 0
    for url in stack.engine_urls():
        with urllib.request.urlopen(f"{url}/admin/requests", timeout=10) as r:
            for e in json.loads(r.read()):
                if e["time"] >= since and e.get("ttft_s") is not None:
                    ttfts.append(e["ttft_s"])
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total{"):
                    hits_tokens += int(float(line.rsplit(" ", 1)[1]))
                elif line.startswith("vllm:prefix_cache_queries_total{"):
                    prompt_tokens += int(float(line.rsplit(" ", 1)[1]))
    return ttfts, hits_tokens, prompt_tokens


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _stack(config: Path, work: Path, name: str, args: argparse.Namespace, lb: str) -> Stack:
    snap = load_snapshot(config)
    # The whole gateway, its store included (the example route reserves budgets).
    opts = StackOptions.on_free_ports(config, work / name, snap, time_scale=args.time_scale,
                                      pool_lb=lb, engine_args=("--num-gpu-blocks", str(args.kv_blocks)))
    return Stack(opts).start()


def run_picker_bench(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-picker-"))
    config, keys = demo_policy(Path(args.config), work / "policy")
    prefixes = make_prefixes([keys[t] for t in sorted(keys)], args.prefixes, args.prefix_tokens, seed=7)
    capacities = {}
    for lb in ("round_robin", "picker"):
        stack = _stack(config, work, f"cal-{lb}", args, lb)
        try:
            url = f"{stack.url}/v1/chat/completions"
            asyncio.run(closed_loop(url, prefixes, args.concurrency, args.warmup))
            capacities[lb] = asyncio.run(closed_loop(url, prefixes, args.concurrency, args.calibrate))
        finally:
            stack.stop()
    capacity = capacities["round_robin"]
    rate = 0.8 * capacity
    print(f"round-robin pool capacity {capacity:.1f} req/s; offered load {rate:.1f} req/s (80%)", flush=True)
    rows = []
    for lb in ("round_robin", "picker"):
        stack = _stack(config, work, lb, args, lb)
        try:
            url = f"{stack.url}/v1/chat/completions"
            asyncio.run(open_loop(url, prefixes, rate, args.warmup, seed=3))  # warm caches, discarded
            since = time.time()
            out = asyncio.run(open_loop(url, prefixes, rate, args.duration, seed=11))
            ttfts, hits, queried = _engine_ttfts(stack, since)
        finally:
            stack.stop()
        lat = out.latencies or []
        rows.append((lb, out, ttfts, hits / max(1, queried), lat))
        print(f"{lb}: ok {out.ok} failed {out.failed} ttft p95 {_pct(ttfts, 0.95) * 1000:.0f} ms", flush=True)
    (_, _, rr_ttft, _, _), (_, _, pk_ttft, _, _) = rows
    gain = 1 - _pct(pk_ttft, 0.95) / _pct(rr_ttft, 0.95)
    lines = ["| pool LB | completed | failed | req/s | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | e2e p50 ms | "
             "e2e p95 ms | prefix-cache hit rate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for lb, o, tt, hit_rate, lat in rows:
        lines.append(f"| {lb} | {o.ok} | {o.failed} | {o.ok / args.duration:.1f} "
                     f"| {statistics.median(tt) * 1000:.0f} | {_pct(tt, 0.95) * 1000:.0f} "
                     f"| {_pct(tt, 0.99) * 1000:.0f} "
                     f"| {statistics.median(lat) * 1000:.0f} | {_pct(lat, 0.95) * 1000:.0f} | {hit_rate:.0%} |")
    table = "\n".join(lines) + (
        f"\n\nCapacity (closed loop, {args.concurrency} clients, {args.calibrate:.0f} s): round-robin "
        f"{capacity:.1f} req/s, picker {capacities['picker']:.1f} req/s. Offered load: {rate:.1f} req/s Poisson "
        f"(80% of round-robin's capacity) for {args.duration:.0f} s after {args.warmup:.0f} s of warm-up. "
        f"Picker TTFT p95 is {gain:.0%} lower than round-robin's.\n")
    return report(table, args.output)


def register(sub: Any) -> None:
    p = sub.add_parser("picker", help="endpoint picker vs round-robin on the simulated pool, one run")
    p.add_argument("--config", default="policy")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--calibrate", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--prefixes", type=int, default=8, help="system prompts per tenant")
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--kv-blocks", type=int, default=1600, help="KV blocks per engine (16 tokens each)")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--output")
    p.set_defaults(func=lambda a: run_picker_bench(a))
