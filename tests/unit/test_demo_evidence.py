"""The demo's evidence is earned when needed, never committed with a date (llmgw/conformance/demo_evidence.py): only
for candidates `llmgw up` simulates, renewed before it expires, reused from a cache when it is the very
record a run would write, and valid under a clock years ahead."""

from __future__ import annotations

import shutil
import subprocess
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import REQUIRED_EVIDENCE
from llmgw.conformance import demo_evidence
from llmgw.conformance.runner import CaseResult, Run
from tests.conftest import EARNED, EXAMPLE_POLICY, ROOT

TODAY = date(2026, 12, 3)
EVERY = {"pool-llama-8b", "pool-embed", "demo-anthropic", "demo-gemini", "demo-bedrock"}
POOLS = {"pool-llama-8b", "pool-embed"}


@pytest.fixture
def bare(tmp_path: Path) -> Path:
    """The example policy as a fresh clone has it: no keys, no evidence."""
    dst = tmp_path / "policy"
    shutil.copytree(EXAMPLE_POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    return dst


class FakeRunner:
    """Stands in for the sandboxed corpus run: records who was run, and passes unless told otherwise."""

    def __init__(self, failing: set[str] | None = None) -> None:
        self.ran: list[str] = []
        self.failing = failing or set()

    def __call__(self, config: Path, name: str, corpus: Any, work: Path, time_scale: float, **_: Any) -> Run:
        self.ran.append(name)
        dep = load_snapshot(config).deployments[name]
        outcome = "fail" if name in self.failing else "pass"
        return Run(dep.ref, dep.fingerprint.adapter, corpus.version, [CaseResult("plain-message", outcome)])


def qualified(policy: Path, today: date) -> set[str]:
    snap = load_snapshot(policy, today=today)
    return {n for n, d in snap.deployments.items() if snap.passing_evidence(d.ref, today) >= REQUIRED_EVIDENCE}


def test_the_repository_ships_no_evidence_and_no_date_a_calendar_reaches(bare: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "policy"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.split()
    assert files and not [f for f in files if f.startswith("policy/evidence/") and f.endswith(".yaml")]
    snap = load_snapshot(bare)  # the dates the gateway acts on: evidence expiry, retirement
    assert not snap.evidence and all(d.retire_at is None for d in snap.deployments.values())


def test_a_bare_policy_wants_both_kinds_for_every_simulated_candidate(bare: Path) -> None:
    snap = load_snapshot(bare)
    assert demo_evidence.wanted(snap, EVERY, TODAY) == {n: set(REQUIRED_EVIDENCE) for n in EVERY}
    # Only what `llmgw up` simulates: with real engines (or none), the pool's candidate is its operator's.
    assert demo_evidence.simulated_by_up(snap, "sim", True) == EVERY
    assert demo_evidence.simulated_by_up(snap, "none", True) == EVERY - POOLS
    assert demo_evidence.simulated_by_up(snap, "sim", False) == POOLS


def test_earned_records_qualify_and_a_second_call_earns_nothing(bare: Path) -> None:
    runner = FakeRunner()
    written = demo_evidence.ensure(bare, EVERY, today=TODAY, runner=runner)
    assert sorted(runner.ran) == sorted(EVERY) and len(written) == 2 * len(EVERY)
    assert qualified(bare, TODAY) == EVERY
    gate = yaml.safe_load((bare / "evidence/demo-gemini-quality-gate.yaml").read_text())
    assert gate["source"] == demo_evidence.ATTESTATION
    assert gate["expires_at"] == (TODAY + timedelta(days=demo_evidence.VALID_DAYS)).isoformat()
    assert demo_evidence.ensure(bare, EVERY, today=TODAY, runner=runner) == []
    assert len(runner.ran) == len(EVERY)


def test_a_candidate_it_does_not_simulate_gets_nothing(bare: Path) -> None:
    runner = FakeRunner()
    demo_evidence.ensure(bare, EVERY - {"pool-llama-8b"}, today=TODAY, runner=runner)
    assert "pool-llama-8b" not in runner.ran
    assert qualified(bare, TODAY) == EVERY - {"pool-llama-8b"}


def test_records_are_earned_again_before_they_expire(bare: Path) -> None:
    runner = FakeRunner()
    demo_evidence.ensure(bare, EVERY, today=TODAY, runner=runner)
    later = TODAY + timedelta(days=demo_evidence.VALID_DAYS - demo_evidence.RENEW_DAYS)  # due now
    assert demo_evidence.wanted(load_snapshot(bare), EVERY, later) == {n: set(REQUIRED_EVIDENCE) for n in EVERY}
    demo_evidence.ensure(bare, EVERY, today=later, runner=runner)
    assert len(runner.ran) == 2 * len(EVERY)
    assert qualified(bare, later + timedelta(days=80)) == EVERY


def test_two_years_ahead_the_demo_still_qualifies(bare: Path) -> None:
    ahead = date.today() + timedelta(days=730)
    demo_evidence.ensure(bare, EVERY, today=ahead, runner=FakeRunner())
    assert qualified(bare, ahead) == EVERY


def test_the_cache_serves_the_same_record_and_nothing_else(bare: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = FakeRunner()
    demo_evidence.ensure(bare, EVERY, today=TODAY, cache=cache, runner=first)
    assert len(first.ran) == len(EVERY) and len(list(cache.glob("*.yaml"))) == len(EVERY)
    again = tmp_path / "again"
    shutil.copytree(EXAMPLE_POLICY, again, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    # A price change voids a record (its basis): that one is earned again, the others come from the cache.
    path = again / "deployments/demo-gemini.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["prices"]["version"] = "2099-01"
    path.write_text(yaml.safe_dump(doc))
    second = FakeRunner()
    demo_evidence.ensure(again, EVERY, today=TODAY, cache=cache, runner=second)
    assert second.ran == ["demo-gemini"]
    assert qualified(again, TODAY) == EVERY


def test_a_failing_run_writes_its_record_and_stops_the_start(bare: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="conformance failed for demo-bedrock"):
        demo_evidence.ensure(bare, EVERY, today=TODAY, cache=cache, runner=FakeRunner(failing={"demo-bedrock"}))
    record = yaml.safe_load((bare / "evidence/demo-bedrock-conformance.yaml").read_text())
    assert record["result"] == "fail"
    assert not (cache / "demo-bedrock-conformance.yaml").exists()  # a failure is never reused
    assert "demo-bedrock" not in qualified(bare, TODAY)


def test_a_record_dated_in_the_future_qualifies_nothing_and_is_not_reused(bare: Path, tmp_path: Path) -> None:
    """Records made under a clock that ran ahead (a cache filled two years ahead, then the clock put
    right) prove nothing yet: the candidate is not qualified, and the cache's records are earned again."""
    cache = tmp_path / "cache"
    ahead = TODAY + timedelta(days=730)
    demo_evidence.ensure(bare, EVERY, today=ahead, cache=cache, runner=FakeRunner())
    assert qualified(bare, ahead) == EVERY
    assert qualified(bare, TODAY) == set()  # dated two years from now: fail closed
    assert qualified(bare, ahead - timedelta(days=1)) == EVERY  # a day's grace: UTC dates, local today
    again = tmp_path / "again"
    shutil.copytree(EXAMPLE_POLICY, again, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    runner = FakeRunner()
    demo_evidence.ensure(again, EVERY, today=TODAY, cache=cache, runner=runner)
    assert sorted(runner.ran) == sorted(EVERY)  # none of the future-dated records reused
    assert qualified(again, TODAY) == EVERY
