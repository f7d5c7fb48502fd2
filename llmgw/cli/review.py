"""`llmgw review [--config DIR]`: a capacity and policy review's questions answered as markdown
(llmgw/ops/review.py)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from llmgw.bench.stats import percentile
from llmgw.cli.common import snapshot_or_report
from llmgw.cli.ledger import ledger_entries, store_url
from llmgw.ops.review import Measured, review
from llmgw.ops.store import store_client


def _ledger(url: str, tenants: list[str]) -> list[dict[str, Any]]:
    """The ledger, or nothing when the store does not answer (the review says "not measured")."""
    try:
        return ledger_entries(store_client(url), tenants)
    except (redis.RedisError, OSError):
        return []


def cmd_review(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    url = store_url(args, snap.gateway.store.url)
    entries = _ledger(url, sorted(snap.gateway.tenants)) if url else []
    contexts = [int(u.get("prompt_tokens") or 0) + int(u.get("completion_tokens") or 0)
                for e in entries if (u := e.get("usage"))]
    p95, source = None, ""
    if args.p95_context_tokens is not None:
        p95, source = args.p95_context_tokens, "given"
    elif contexts:
        p95, source = percentile(contexts, 95), f"the ledger's {len(contexts)} entries with usage"
    sweep = json.loads(Path(args.sweep).read_text()).get("slo_utilization") if args.sweep else None
    sources = Counter(str(e.get("usage_source")) for e in entries if e.get("usage_source"))
    used = [u for e in entries if (u := e.get("usage"))]
    # The reference request candidates are priced for: as given, else the ledger's mean, else 1000/250.
    def mean(field: str, default: float) -> float:
        return sum(int(u.get(field) or 0) for u in used) / len(used) if used else default

    tokens_in = args.input_tokens or mean("prompt_tokens", 1000.0)
    tokens_out = args.output_tokens or mean("completion_tokens", 250.0)
    print(review(snap, Measured(p95, source, sweep, dict(sources) or None, tokens_in, tokens_out)), end="")
    return 0


def register(sub: Any) -> None:
    r = sub.add_parser("review", help="a capacity and policy review's questions, answered from the configuration "
                       "and measurements")
    r.add_argument("--config", default="policy")
    r.add_argument("--state-dir", default=".llmgw")
    r.add_argument("--store-url", help="the ledger's store (default: llmgw up's, from STATE_DIR/up.json)")
    r.add_argument("--p95-context-tokens", type=int, help="instead of the ledger's p95 of prompt + completion")
    r.add_argument("--sweep", help="a sweep's results (JSON with slo_utilization: pool -> utilisation)")
    r.add_argument("--input-tokens", type=float, help="per request, for pricing candidates per accepted task "
                                                      "(default: the ledger's mean, else 1000)")
    r.add_argument("--output-tokens", type=float, help="likewise (default: the ledger's mean, else 250)")
    r.set_defaults(func=cmd_review)
