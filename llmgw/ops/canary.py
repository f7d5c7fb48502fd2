"""`llmgw canary watch`: the automatic rollback of a route's canary (issue 16, part 2).

For each route with a `canary`, over its window of ledger entries (`canary: canary` - the canary was
tried first - against `canary: stable`): the error rate of the first attempt (a 5xx or no answer from
the candidate tried first, whatever a fallback made of it afterwards) and the time to first byte p95.
When both sides have `min_requests` and the canary's error rate exceeds the stable one's by more than
`max_error_rate_increase`, or its TTFT p95 by more than `max_ttft_p95_ratio` times, the canary is
removed from the route as an audited revision (`llmgw apply --from` a staged copy, who
`canary-watch`, the reason in its changes) and the workers reload: its share goes back to the stable
candidates. Run it beside the gateway (`--interval`), or once from a scheduler (`--once`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import yaml

from extproc.config import ConfigError, load_snapshot
from extproc.config.schema import Canary
from llmgw.bench.stats import percentile
from llmgw.ops.ledger import ledger_entries, ttft_ms
from llmgw.ops.reload import admin_token, reload_workers, status_urls
from llmgw.ops.revisions import apply
from llmgw.ops.store import store_client, store_url

WHO = "canary-watch"


@dataclass(frozen=True)
class Side:
    requests: int
    error_rate: float
    ttft_p95_ms: float | None


def side(entries: Sequence[dict[str, Any]]) -> Side:
    def failed(e: dict[str, Any]) -> bool:
        first = (e.get("attempts") or [{}])[0]
        return int(first.get("status") or 0) >= 500 or (not first.get("status") and e.get("termination") != "complete")

    ttft = [t for e in entries if (t := ttft_ms(e)) is not None]
    return Side(len(entries), sum(map(failed, entries)) / len(entries) if entries else 0.0,
                percentile(ttft, 95) if ttft else None)


def verdict(canary: Side, stable: Side, cfg: Canary) -> str | None:
    """Why the canary should be rolled back (None: it holds, or too few requests to say)."""
    if canary.requests < cfg.min_requests or stable.requests < cfg.min_requests:
        return None
    if canary.error_rate - stable.error_rate > cfg.max_error_rate_increase:
        return (f"error rate {canary.error_rate:.1%} against {stable.error_rate:.1%} stable "
                f"(margin {cfg.max_error_rate_increase:.0%}; {canary.requests} / {stable.requests} requests)")
    if canary.ttft_p95_ms and stable.ttft_p95_ms and canary.ttft_p95_ms > cfg.max_ttft_p95_ratio * stable.ttft_p95_ms:
        return (f"TTFT p95 {canary.ttft_p95_ms:.0f} ms against {stable.ttft_p95_ms:.0f} ms stable "
                f"(ratio bound {cfg.max_ttft_p95_ratio})")
    return None


def without_canary(directory: Path, route: str, work: Path) -> Path:
    """A staged copy of the live directory with the route's canary removed."""
    stage = work / "policy"
    shutil.copytree(directory, stage)
    for path in (stage / "routes").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and doc.get("route_contract") == route:
            doc.pop("canary", None)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return stage


def watch_once(client: Any, directory: Path, status_urls: list[str], now: float | None = None,
               token: str = "", say: Callable[[str], None] = print) -> list[str]:
    """Check every canary once; roll back the ones that regressed. Returns what was rolled back, why.
    `say` gets a line per route (what it saw, the verdict): the command prints them; `llmgw up`'s
    loop keeps them in its state."""
    snap = load_snapshot(directory)
    now = now or time.time()
    entries = ledger_entries(client, sorted(snap.gateway.tenants))
    rolled = []
    for name, route in sorted(snap.routes.items()):
        cfg = route.canary
        if cfg is None:
            continue
        recent = [e for e in entries if e.get("route") == name and float(e.get("time") or 0) >= now - cfg.window_s]
        c, s = side([e for e in recent if e.get("canary") == "canary"]), side([e for e in recent
                                                                             if e.get("canary") == "stable"])
        why = verdict(c, s, cfg)
        say(f"route {name}: canary {cfg.deployment} {c.requests} requests, {c.error_rate:.1%} errors, TTFT p95 "
            f"{c.ttft_p95_ms or 0:.0f} ms; stable {s.requests}, {s.error_rate:.1%}, {s.ttft_p95_ms or 0:.0f} ms"
            f" -> {'ROLL BACK: ' + why if why else 'holds'}")
        if why is None:
            continue
        with tempfile.TemporaryDirectory(prefix="llmgw-canary-") as tmp:
            entry = apply(client, directory, f"{WHO} ({name}: {why})", source=without_canary(directory, name,
                                                                                           Path(tmp)))
        if not entry.accepted:
            print(f"  the rollback was refused: {'; '.join(entry.why)}", file=sys.stderr)
            continue
        failed = reload_workers(status_urls, entry.revision, token) if status_urls else []
        for line in failed:
            print(f"  a worker did not take revision {entry.revision}: {line}", file=sys.stderr)
        rolled.append(f"{name}: {why}")
    return rolled


def cmd_watch(args: argparse.Namespace) -> int:
    directory = Path(args.config).resolve()
    try:
        url = store_url(args, load_snapshot(directory).gateway.store.url)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not url:
        print("error: no store: give --store-url, set store.url, or run `llmgw up`", file=sys.stderr)
        return 2
    client = store_client(url)
    urls, token = status_urls(args), admin_token(args)
    while True:
        try:
            rolled = watch_once(client, directory, urls, token=token)
        except (ConfigError, redis.RedisError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            rolled = []
        if args.once:
            return 1 if rolled else 0
        time.sleep(args.interval)
