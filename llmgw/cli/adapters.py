"""`llmgw adapters loss-table`: what each adapter does with each field of the request contract, as
the markdown table docs/guide/providers.md shows (extproc/shapes/; the tables are data there)."""

from __future__ import annotations

import argparse
from typing import Any

from extproc.chat import CONTRACT_FIELDS
from extproc.shapes.loss import CACHE_CONTROL, Support, describe
from extproc.shapes.registry import SHAPES

COLUMNS = {heading: table for shape in SHAPES for heading, table in shape.loss_columns.items()}


def loss_table() -> str:
    fields = [*(f for f in CONTRACT_FIELDS if f != "model"), CACHE_CONTROL]  # (a part's or a tool's)
    lines = ["| field | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for f in fields:
        lines.append(f"| `{f}` | " + " | ".join(describe(t.get(f, Support.UNSUPPORTED)) for t in COLUMNS.values())
                     + " |")
    return "\n".join(lines)


def cmd_loss_table(_: argparse.Namespace) -> int:
    print(loss_table())
    return 0


def register(sub: Any) -> None:
    a = sub.add_parser("adapters", help="the upstream API shapes the gateway translates to")
    asub = a.add_subparsers(dest="adapters_command", required=True)
    t = asub.add_parser("loss-table", help="what each adapter does with each request field (markdown)")
    t.set_defaults(func=cmd_loss_table)
