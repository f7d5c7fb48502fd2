"""`llmgw chaos`: the command line of llmgw/chaos/inject.py."""

from __future__ import annotations

from typing import Any

from llmgw.chaos.inject import cmd_chaos


def register(sub: Any) -> None:
    p = sub.add_parser("chaos", help="inject each failure of the fault table and check invariants 3-8 after it")
    p.add_argument("--config", default="policy", help="the policy to copy (the demo's shape)")
    p.add_argument("--pool-route", default="chat-default")
    p.add_argument("--fallback-route", default="chat-fallback")
    p.add_argument("--only", help="comma-separated fault names")
    p.add_argument("--time-scale", type=float, default=1.0, help="the simulated engines' (real s per simulated s)")
    p.add_argument("--work-dir", help="where the gateway's state and logs go (default: a new temporary directory)")
    p.add_argument("--output", help="also write the table here")
    p.set_defaults(func=cmd_chaos)
