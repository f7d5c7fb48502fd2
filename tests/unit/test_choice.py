"""Candidates chosen by cost per accepted task among the eligible (llmgw/ops/choice.py): a cheap candidate
that answers few tasks right costs more per accepted task than a dearer one that answers them all, and
a candidate without passing evidence is never chosen, however cheap."""

from __future__ import annotations

import shutil
from datetime import date
from pathlib import Path

import yaml

from extproc.config import load_snapshot
from llmgw.conformance.record import record_path
from llmgw.ops import choice
from tests.conftest import POLICY


def chosen(policy: Path, pool_score: float) -> choice.Priced | None:
    gate = record_path(policy, "pool-llama-8b", "quality_gate", "chat-fallback")
    doc = yaml.safe_load(gate.read_text())
    doc.update(score=pool_score, threshold=0.01)  # as a gate graded at the class's threshold would say
    gate.write_text(yaml.safe_dump(doc))
    snap = load_snapshot(policy)
    route = snap.routes["chat-fallback"]
    return choice.cheapest(choice.price(snap, route, date.today(), 1000, 250), route.request_class)


def test_the_cheapest_per_accepted_task_among_the_eligible(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["request_classes"]["read_only_chat"]["quality"]["threshold"] = 0.01  # both pass the gate below
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    # The pool costs 0.0003 USD per request, the hosted candidate 0.00675 (their prices, 1000 in / 250 out).
    best = chosen(policy, 0.5)
    assert best is not None and best.deployment == "pool-llama-8b" and abs(best.cost_per_accepted_task - 0.0006) < 1e-9
    best = chosen(policy, 0.02)  # right on 2% of the tasks: 0.015 per accepted task
    assert best is not None and best.deployment == "demo-anthropic"
    record_path(policy, "demo-anthropic", "conformance", "chat-fallback").unlink()  # not eligible any more
    best = chosen(policy, 0.02)
    assert best is not None and best.deployment == "pool-llama-8b"
    snap = load_snapshot(policy)
    priced = choice.price(snap, snap.routes["chat-fallback"], date.today(), 1000, 250)
    assert [(p.deployment, p.eligible) for p in priced] == [("pool-llama-8b", True), ("demo-anthropic", False)]
    assert "no passing conformance" in priced[1].why_not
