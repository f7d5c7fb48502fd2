"""`llmgw evidence reevaluate`: the command line of llmgw/ops/reevaluate.py."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from llmgw.cli.common import snapshot_or_report
from llmgw.ops.reevaluate import Bounds, after_earning, evaluate, objectives_of, void_files, windows
from llmgw.ops.store import store_client, store_url


def register(sub: Any) -> None:
    e = sub.add_parser("evidence", help="evidence records: re-evaluation triggers")
    esub = e.add_subparsers(dest="evidence_command", required=True)
    r = esub.add_parser("reevaluate", help="provider drift, SLO regression and workload shift from the ledger")
    r.add_argument("--config", default="policy")
    r.add_argument("--store-url")
    r.add_argument("--state-dir", default=".llmgw")
    r.add_argument("--window-hours", type=float, default=24.0)
    r.add_argument("--baseline-hours", type=float, default=168.0, help="the window before it, for workload shift")
    r.add_argument("--max-failure-share", type=float, default=Bounds.max_failure_share)
    r.add_argument("--ttft-p95-ms", type=float, help="SLO regression bound on streams' time to first byte")
    r.add_argument("--e2e-p95-ms", type=float, help="SLO regression bound on JSON answers' end to end")
    r.add_argument("--max-mix-shift", type=float, default=Bounds.max_mix_shift)
    r.add_argument("--max-length-ratio", type=float, default=Bounds.max_length_ratio)
    r.add_argument("--min-requests", type=int, default=Bounds.min_requests)
    r.add_argument("--dry-run", action="store_true", help="say what fired; write no void record")
    r.set_defaults(func=cmd_reevaluate)


def cmd_reevaluate(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    url = store_url(args, snap.gateway.store.url)
    if not url:
        print("error: no store: give --store-url, set store.url, or run `llmgw up`", file=sys.stderr)
        return 2
    try:
        window, before = windows(store_client(url), sorted(snap.gateway.tenants), time.time(),
                                 args.window_hours * 3600, args.baseline_hours * 3600)
    except redis.RedisError as e:
        print(f"error: the store: {e}", file=sys.stderr)
        return 2
    bounds = Bounds(args.max_failure_share, args.ttft_p95_ms, args.e2e_p95_ms, args.max_mix_shift,
                    args.max_length_ratio, args.min_requests, objectives_of(snap.gateway))
    window = after_earning(window, snap)
    findings = evaluate(window, before, bounds)
    print(f"{len(window)} ledger entries in the last {args.window_hours:g} h, {len(before)} in the "
          f"{args.baseline_hours:g} h before")
    for f in findings:
        print(f"  {f.deployment}: {f.trigger}: {f.reason}")
    if not findings:
        print("  no trigger fired")
        return 0
    if args.dry_run:
        return 1
    for path in void_files(findings, dict(snap.deployments), Path(args.config), datetime.now(UTC)):
        print(f"  wrote {path} (its evidence is void: the candidate leaves routing until re-earned)")
    return 1
