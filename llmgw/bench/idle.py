"""`llmgw bench idle`: what ext_proc workers cost while no request comes (the endpoint picker's
scraping), with many engines: one process serves vLLM-shaped /metrics pages on N ports, and W ext_proc
workers are pointed at them as one pool; each worker's CPU time (user + system, /proc) over a quiet
interval, as a share of one core, and the scrapes the engines received per second."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

from extproc.config import load_snapshot
from llmgw.bench.kit import METRICS, demo_policy, report
from llmgw.local.procs import Child, cpu_seconds, free_port, http_ok, python_module, wait_until


def serve_metrics(ports: list[int]) -> None:
    """vLLM-shaped /metrics on every port, and GET /hits (on the first) with the scrapes so far."""
    from aiohttp import web

    hits = [0]

    async def page(_: web.Request) -> web.Response:
        hits[0] += 1
        return web.Response(text=METRICS)

    async def count(_: web.Request) -> web.Response:
        return web.json_response({"hits": hits[0]})

    async def main() -> None:
        for port in ports:
            app = web.Application()
            app.router.add_get("/metrics", page)
            app.router.add_get("/hits", count)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    import asyncio

    asyncio.run(main())


def _hits(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/hits", timeout=5) as r:
        return int(json.load(r)["hits"])


def run_idle_bench(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-idle-"))
    config, _ = demo_policy(Path(args.config), work / "policy")
    ports = [free_port() for _ in range(args.engines)]
    engines = Child("engines", [sys.executable, "-m", "llmgw.bench.idle", "--serve-metrics",
                                ",".join(map(str, ports))], work / "engines.log").start()
    wait_until(lambda: http_ok(f"http://127.0.0.1:{ports[-1]}/metrics"), 30, "engines", engines)
    pool = "engine-pool=" + ",".join(f"127.0.0.1:{p}" for p in ports)
    gw = load_snapshot(config).gateway
    env = {ref.partition(":")[2]: secrets.token_hex(32)  # the gateway's own secrets: throwaway ones
           for ref in (gw.cache_salt_secret_ref, gw.store.replay_key_ref) if ref and ref.startswith("env:")}
    workers: list[Child] = []
    rows: list[str] = []
    try:
        for i in range(args.workers):
            status = free_port()
            shared = ["--picker-dir", str(work / "picker")] if not args.no_sharing else []
            workers.append(Child(f"extproc-{i}", python_module(
                "extproc", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}", f"--pool={pool}",
                "--status-listen", f"127.0.0.1:{status}", *shared),
                work / f"extproc-{i}.log", env=env).start())
            wait_until(partial(http_ok, f"http://127.0.0.1:{status}/status"), 60, f"extproc-{i}", workers[-1])
        time.sleep(args.settle)  # start-up done, no request since
        before, hits, t0 = [cpu_seconds({"w": [w]}) for w in workers], _hits(ports[0]), time.monotonic()
        time.sleep(args.duration)
        elapsed = time.monotonic() - t0
        after = [cpu_seconds({"w": [w]}) for w in workers]
        scrapes = (_hits(ports[0]) - hits) / elapsed
        shares = [(a.get("w", 0.0) - b.get("w", 0.0)) / elapsed for a, b in zip(after, before, strict=True)]
    finally:
        for w in workers:
            w.stop()
        engines.stop()
    rows.append(f"| {args.engines} | {args.workers} | {'no' if args.no_sharing else 'yes'} | "
                + " / ".join(f"{s:.2%}" for s in shares) + f" | {sum(shares):.2%} | {scrapes:.1f} |")
    table = ("| engines | workers | shared scraper | CPU per worker (share of one core) | all workers | "
             "scrapes/s |\n|---|---|---|---|---|---|\n" + "\n".join(rows) +
             f"\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.duration:.0f} s without requests, "
             f"after {args.settle:.0f} s to settle.\n")
    return report(table, args.output)


def register(bsub: Any) -> None:
    b = bsub.add_parser("idle", help="ext_proc workers' CPU with no traffic and many engines")
    b.add_argument("--config", default="policy")
    b.add_argument("--engines", type=int, default=32)
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--duration", type=float, default=20.0)
    b.add_argument("--settle", type=float, default=5.0)
    b.add_argument("--no-sharing", action="store_true", help="each worker scrapes (no --picker-dir)")
    b.add_argument("--output")
    b.set_defaults(func=run_idle_bench)


if __name__ == "__main__":
    serve_metrics([int(p) for p in sys.argv[sys.argv.index("--serve-metrics") + 1].split(",")])
