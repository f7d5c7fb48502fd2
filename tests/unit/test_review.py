"""`llmgw review` (issue 15, part 8) on the demo policy: every question answered, from the
configuration and the measurements given, and "not measured" where there are none."""

from __future__ import annotations

import shutil
from datetime import date, timedelta
from pathlib import Path

from extproc.config import load_snapshot
from extproc.config.schema import ModelGeometry
from llmgw.ops.review import EXAMPLE_70B, Measured, kv_bytes_per_token, review
from tests.conftest import POLICY
from tests.helpers import llmgw

# Today's: the session's evidence is earned today, and a record dated after the day it is read counts
# for nothing (extproc/config/loader.py passing_evidence).
TODAY = date.today()
RETIRES = TODAY + timedelta(days=395)


def test_the_kv_example_a_70b_class_model() -> None:
    per = kv_bytes_per_token(EXAMPLE_70B)
    assert per == 320 * 1024  # 320 KiB per token
    assert round(per * 8000 / 1e9, 1) == 2.6  # GB for one 8,000-token sequence
    assert kv_bytes_per_token(ModelGeometry(layers=32, kv_heads=8, head_dim=128)) == 128 * 1024  # Llama 3.1 8B


def test_every_question_is_answered_on_the_demo_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy"  # the demo with a retirement scheduled (the example sets no date)
    shutil.copytree(POLICY, policy)
    path = policy / "deployments/demo-anthropic.yaml"
    path.write_text(path.read_text() + f"retire_at: {RETIRES}\nretire_owner: platform-inference\n"
                    "retire_replacement: chat-default\n")
    text = review(load_snapshot(policy), Measured(p95_context_tokens=8000, context_source="given",
                                                   usage_sources={"reported": 9, "estimated": 1}), TODAY)
    assert "320 KiB per token holds 2.6 GB for one 8,000-token sequence" in text
    assert "- pool-llama-8b (h100-sxm-80g): 128 KiB per token; 1.05 GB at the p95 context" in text
    assert "Utilisation at the latency SLO" in text and "Not measured: run `llmgw bench sweep`" in text
    # Without H100s the pools' routes have nothing left; the fallback route keeps its hosted model.
    assert "- h100-sxm-80g: routes with no candidate left: chat-default, embed-default; routes that keep another: " \
           "chat-fallback (left: demo-anthropic)" in text
    assert "- restricted: no route" in text  # no candidate serves restricted data
    assert "chat-fallback [pool-llama-8b passes; demo-anthropic passes; the same corpus 2026-12-01.2]" in text
    assert "Ledger entries by usage source: estimated: 1 (10%), reported: 9 (90%)." in text
    assert f"- demo-anthropic: retires {RETIRES} (in 395 days); owner platform-inference, replacement " \
           "chat-default (qualified); on its routes: chat-anthropic -> NO qualified replacement; " \
           "chat-fallback -> pool-llama-8b" in text


def test_the_command_prints_markdown_and_says_what_is_not_measured(tmp_path: object) -> None:
    out = llmgw("review", "--config", str(POLICY), "--state-dir", "/nonexistent")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# Review of revision ")
    assert "p95 context length: not measured" in out.stdout
    for heading in ("KV memory per sequence", "Utilisation at the latency SLO", "When an accelerator type",
                    "Policy-equivalent routes", "Who counts the tokens", "Deprecations"):
        assert f"## {heading}" in out.stdout
