"""`llmgw canary watch`: the command line of llmgw/ops/canary.py."""

from __future__ import annotations

from typing import Any

from llmgw.ops.canary import cmd_watch


def register(sub: Any) -> None:
    c = sub.add_parser("canary", help="canaries: automatic rollback on regression")
    csub = c.add_subparsers(dest="canary_command", required=True)
    w = csub.add_parser("watch", help="compare each canary with its stable candidates; roll back a regression")
    w.add_argument("--config", default="policy", help="the live policy directory")
    w.add_argument("--store-url")
    w.add_argument("--state-dir", default=".llmgw")
    w.add_argument("--reload-url", action="append", help="a worker's status URL (default: up.json's)")
    w.add_argument("--admin-token-file", help="the workers' admin token (default: up.json's)")
    w.add_argument("--interval", type=float, default=15.0)
    w.add_argument("--once", action="store_true", help="check once; exit 1 when something was rolled back")
    w.set_defaults(func=cmd_watch)
