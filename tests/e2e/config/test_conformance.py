"""The conformance corpus and `llmgw conformance` (issue 13's evidence): the corpus runs through a real
gateway (Envoy, ext_proc, Valkey) against each simulated shape over real HTTP and writes the record
that qualifies the candidate; a corrupted provider fails it; a failing, missing or stale record (the
fingerprint changed) qualifies nothing. The hosted shapes' runs are in test_conformance_providers.py,
the checks on hand-made outcomes in tests/unit/test_conformance_checks.py."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import Evidence
from llmgw.conformance import runner
from llmgw.conformance.corpus import load_corpus
from llmgw.conformance.record import record_path, write_record
from tests.conftest import POLICY, repin

CORPUS = load_corpus()
CASES = {c.id: c for c in CORPUS.cases}
# vLLM never refuses: the OpenAI-shaped simulator takes no refusal fault, so these cases do not run there.
REFUSALS = {"refusal", "refusal-streamed"}


def conformance(policy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "conformance", "--config", str(policy), *args],
                          capture_output=True, text=True, timeout=300)


def check_says(policy: Path) -> str:
    return subprocess.run([sys.executable, "-m", "llmgw", "check", str(policy)], capture_output=True, text=True,
                          timeout=60).stdout


def record(policy: Path, deployment: str, route: str = "chat-default") -> Evidence:
    return Evidence.model_validate(yaml.safe_load(record_path(policy, deployment, "conformance", route).read_text()))


def candidate_state(policy: Path, route: str, deployment: str) -> str:
    """What `llmgw check` says of one candidate of one route."""
    prefix = f"route {route}: candidate {deployment}: "
    return next(line.removeprefix(prefix) for line in check_says(policy).splitlines() if line.startswith(prefix))


@pytest.mark.e2e
def test_the_pool_passes_and_its_record_is_what_qualifies_it(policy: Path) -> None:
    record_path(policy, "pool-llama-8b", "conformance", "chat-default").unlink()
    assert candidate_state(policy, "chat-default", "pool-llama-8b").startswith("NOT ELIGIBLE: no passing conformance")
    r = conformance(policy, "--route", "chat-default")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = record(policy, "pool-llama-8b")
    snap = load_snapshot(policy)
    assert rec.deployment_ref == snap.deployments["pool-llama-8b"].ref and rec.result == "pass"
    assert rec.corpus_version == CORPUS.version and rec.adapter == "openai-compat@1"
    results = {c.id: c.result for c in rec.cases}
    assert results == {k: "not_run" if k in REFUSALS else "pass" for k in CASES}  # every other case ran
    assert "conformance" in snap.passing_evidence(rec.deployment_ref, snap.routes["chat-default"], date.today())
    assert rec.route == "chat-default" and rec.basis is not None
    assert rec.basis.route_policy_digest == snap.routes["chat-default"].policy_digest
    assert rec.basis.corpus_digest == CORPUS.digest
    assert "qualified" in check_says(policy) and "NOT ELIGIBLE" not in check_says(policy)


@pytest.mark.e2e
def test_changing_a_fingerprint_field_voids_the_record(policy: Path) -> None:
    dep_path = policy / "deployments/pool-llama-8b.yaml"
    dep = yaml.safe_load(dep_path.read_text())
    dep["fingerprint"]["precision"] = "fp8"  # another served system
    dep_path.write_text(yaml.safe_dump(dep))
    repin(policy, "pool-llama-8b")
    # The old records name the old digest.
    assert candidate_state(policy, "chat-default", "pool-llama-8b") == \
        "NOT ELIGIBLE: no passing conformance, quality_gate evidence"
    assert conformance(policy, "--deployment", "pool-llama-8b").returncode == 0  # earned again for fp8
    # Under the first route that has it (chat-default), whose quality gate is still to be earned; not
    # under chat-fallback's other retry policy.
    assert candidate_state(policy, "chat-default", "pool-llama-8b") == "NOT ELIGIBLE: no passing quality_gate evidence"
    assert candidate_state(policy, "chat-fallback", "pool-llama-8b").startswith(
        "NOT ELIGIBLE: no passing conformance, quality_gate evidence for this route's retry/fallback policy")


@pytest.mark.e2e
def test_a_corrupted_provider_fails_the_corpus_and_is_not_qualified(policy: Path, tmp_path: Path) -> None:
    run = runner.run(policy, "pool-llama-8b", CORPUS, tmp_path / "work",
                     engine_args=("--corrupt", "usage", "--corrupt", "tool_calls"))
    failed = {r.id: r.detail for r in run.results if r.result == "fail"}
    assert not run.passed
    assert "no usage" in failed["plain-message"] and "no usage" in failed["stream-with-usage"]
    # Calls whose arguments do not parse: the gateway's answer checks refuse them before the corpus can.
    assert "answer_rejected" in failed["tool-auto"], failed
    assert "stream ended interrupted" in failed["tool-call-streamed"], failed  # before the call reached it
    assert "context-limit" not in failed  # refused by the gateway before the provider: still conformant
    before = load_snapshot(policy)
    write_record(policy, before, "pool-llama-8b", before.routes["chat-default"], run.evidence(date.today(), 30),
                 run.corpus_digest)
    snap = load_snapshot(policy)
    assert "conformance" not in snap.passing_evidence(run.deployment_ref, snap.routes["chat-default"], date.today())
    assert candidate_state(policy, "chat-default", "pool-llama-8b") == "NOT ELIGIBLE: no passing conformance evidence"


def test_a_partial_run_writes_no_record(policy: Path) -> None:
    r = conformance(policy, "--deployment", "pool-llama-8b", "--case", "plain-message")
    assert r.returncode == 2 and "qualifies nothing" in r.stderr


def test_a_record_cannot_say_pass_over_a_failed_case() -> None:
    doc = yaml.safe_load(record_path(POLICY, "pool-llama-8b", "conformance", "chat-default").read_text())
    doc["cases"][0] = {"id": doc["cases"][0]["id"], "result": "fail", "detail": "x"}
    with pytest.raises(ValueError, match="a case failed"):
        Evidence.model_validate(doc)


def test_the_demo_record_was_written_by_the_command_against_the_current_corpus() -> None:
    rec = record(POLICY, "pool-llama-8b")
    assert rec.source == runner.SOURCE and rec.corpus_version == CORPUS.version
    assert {c.id for c in rec.cases} == set(CASES)
