"""`llmgw adapters loss-table`: what each adapter does with each field of the request contract, as
the markdown table the README shows (extproc/adapters/; the tables are data there)."""

from __future__ import annotations

import argparse
from typing import Any

from extproc.adapters.anthropic import LOSS_TABLE as ANTHROPIC
from extproc.adapters.bedrock import LOSS_TABLE as BEDROCK
from extproc.adapters.gemini import LOSS_TABLE as GEMINI
from extproc.adapters.loss import Support, describe
from extproc.adapters.openai import TABLES as OPENAI
from extproc.chat import CONTRACT_FIELDS

COLUMNS = {"openai (vLLM pool)": OPENAI["vllm"], "openai (OpenAI, Azure)": OPENAI["openai"],
           "anthropic": ANTHROPIC, "gemini": GEMINI, "bedrock": BEDROCK}


def loss_table() -> str:
    fields = [f for f in CONTRACT_FIELDS if f != "model"]
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
