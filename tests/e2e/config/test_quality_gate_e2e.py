"""Evidence earned, not asserted (invariant 17): `llmgw evaluate` grades a route's candidates on its request
class's task-quality corpus through a sandboxed gateway and writes the quality_gate record - passing with
the simulator's answer quality at 1.0, failing at 0.3 - and routing follows the records; a changed
corpus, shape code or route policy voids them and moves routing, through the real Envoy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import Evidence
from extproc.corpora import quality_corpus
from llmgw.conformance.record import record_path
from llmgw.local.stack import Stack
from llmgw.quality.corpus import load_quality
from tests.conftest import DEMO_KEYS, POLICY, serving_directory, start_stack
from tests.helpers import chat_body, llmgw, request

KEY = DEMO_KEYS["acme"]
CORPUS = load_quality(quality_corpus("general", POLICY))


def evaluate(policy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "evaluate", "--config", str(policy), *args],
                          capture_output=True, text=True, timeout=300)


def gate(policy: Path, deployment: str, route: str) -> Evidence:
    return Evidence.model_validate(yaml.safe_load(record_path(policy, deployment, "quality_gate", route).read_text()))


def state(policy: Path, route: str, deployment: str) -> str:
    prefix = f"route {route}: candidate {deployment}: "
    out = llmgw("check", str(policy)).stdout
    return next(line.removeprefix(prefix) for line in out.splitlines() if line.startswith(prefix))


@pytest.mark.e2e
def test_evaluate_earns_a_passing_gate_and_a_failing_one_takes_the_candidate_out(policy: Path) -> None:
    record_path(policy, "pool-llama-8b", "quality_gate", "chat-default").unlink()
    # Only a record earned under chat-fallback's other retry policy is left: it does not count here.
    assert state(policy, "chat-default", "pool-llama-8b").startswith(
        "NOT ELIGIBLE: no passing quality_gate evidence for this route's retry/fallback policy")
    r = evaluate(policy, "--route", "chat-default", "--sim-quality", "1.0")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = gate(policy, "pool-llama-8b", "chat-default")
    snap = load_snapshot(policy)
    assert (rec.result, rec.score, rec.threshold, rec.request_class) == ("pass", 1.0, 0.8, "read_only_chat")
    assert rec.source == "llmgw evaluate" and rec.corpus_version == CORPUS.version
    assert [c.id for c in rec.cases] == [t.id for t in CORPUS.tasks] and {c.result for c in rec.cases} == {"pass"}
    assert rec.basis is not None and rec.basis.corpus_digest == CORPUS.digest
    assert rec.basis.route_policy_digest == snap.routes["chat-default"].policy_digest
    assert "score 1.0000 against threshold 0.8: PASS" in r.stdout
    assert state(policy, "chat-default", "pool-llama-8b") == "qualified"

    # The same candidate, graded again with the simulator right on 30% of the tasks: it fails the gate.
    r = evaluate(policy, "--route", "chat-default", "--sim-quality", "0.3")
    assert r.returncode == 1, r.stdout + r.stderr
    rec = gate(policy, "pool-llama-8b", "chat-default")
    assert rec.result == "fail" and rec.score is not None and rec.score < 0.8
    failed = [c for c in rec.cases if c.result == "fail"]
    assert failed and all(c.detail.split(":")[0] in ("extraction", "tool_selection", "arithmetic", "refusal")
                          for c in failed)
    assert state(policy, "chat-default", "pool-llama-8b") == "NOT ELIGIBLE: no passing quality_gate evidence"


def test_evaluate_refuses_what_it_cannot_grade(policy: Path) -> None:
    r = evaluate(policy, "--route", "embed-default")
    assert r.returncode == 2 and "request class embeddings declares no quality gate" in r.stderr
    r = evaluate(policy, "--route", "chat-default", "--candidate", "demo-gemini")
    assert r.returncode == 2 and "not a candidate of chat-default" in r.stderr


# --- routing follows the records, through the real Envoy -------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("quality-gate")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    s = start_stack(tmp / "state", policy, simulate_providers=True)
    yield s
    s.stop()




def served_by(stack: Stack, route: str) -> str:
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(route, max_tokens=4),
                headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    if r.status != 200:
        assert r.status == 503 and b"no_qualified_route" in r.body, r.body
        return "503"
    return str(r.headers["x-llmgw-deployment"])


def edit_yaml(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def shape_changed(policy: Path) -> None:
    """The pool's records on chat-fallback as the openai shape's code would leave them after an edit of it:
    earned by other code."""
    for kind in ("conformance", "quality_gate"):
        edit_yaml(record_path(policy, "pool-llama-8b", kind, "chat-fallback"),
                  lambda d: d["basis"].update(shape_digest="0" * 16))


def corpus_changed(policy: Path) -> None:
    """The class's quality corpus is now the policy's own copy of the general one, with a task edited."""
    shutil.copy(quality_corpus("general", policy), policy / "tasks.yaml")
    edit_yaml(policy / "tasks.yaml", lambda d: d["tasks"][0]["expect"]["json"].update(quantity=4))
    edit_yaml(policy / "gateway.yaml",
              lambda d: d["request_classes"]["read_only_chat"]["quality"].update(corpus="tasks.yaml"))


def route_policy_changed(policy: Path) -> None:
    edit_yaml(policy / "routes/chat-fallback.yaml", lambda d: d["retry"].update(
        eligible_failures=["connect_before_send", "unavailable", "no_first_byte"]))


@pytest.mark.parametrize(("change", "fallback_to"), [
    (shape_changed, "demo-anthropic"),  # the pool's records only: the other candidate serves
    (corpus_changed, "503"),  # every chat candidate's quality gate
    (route_policy_changed, "503"),  # every record earned under the route's old policy
], ids=["shape", "corpus", "route policy"])
def test_a_change_to_what_earned_the_evidence_moves_routing(gw: Stack, tmp_path: Path,
                                                             change: Callable[[Path], None], fallback_to: str) -> None:
    policy = gw.snapshot.directory
    kept = tmp_path / "kept"
    shutil.copytree(policy, kept)
    try:
        serving_directory(gw)
        assert served_by(gw, "chat-fallback") == "pool-llama-8b"
        change(policy)
        serving_directory(gw)
        assert served_by(gw, "chat-fallback") == fallback_to
        assert served_by(gw, "chat-gemini") == ("503" if change is corpus_changed else "demo-gemini")
    finally:
        for folder in ("evidence", "routes"):
            shutil.rmtree(policy / folder)
            shutil.copytree(kept / folder, policy / folder)
        shutil.copy(kept / "gateway.yaml", policy / "gateway.yaml")
        (policy / "tasks.yaml").unlink(missing_ok=True)
    serving_directory(gw)
    assert served_by(gw, "chat-fallback") == "pool-llama-8b"
