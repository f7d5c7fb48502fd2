"""The demo's evidence is earned when needed, never committed with a date (llmgw/conformance/demo_evidence.py): only
for candidates `llmgw up` simulates, renewed before it expires, reused from a cache when it is the very
record a run would write, and valid under a clock years ahead."""

from __future__ import annotations

import shutil
import subprocess
from datetime import date, timedelta
from pathlib import Path

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.corpora import quality_corpus
from llmgw.conformance import demo_evidence
from llmgw.conformance.corpus import corpus_for
from llmgw.conformance.demo_evidence import Earned
from llmgw.conformance.runner import CaseResult, Run
from llmgw.quality.corpus import load_quality
from llmgw.quality.evaluate import Evaluation
from tests.conftest import EARNED, EXAMPLE_POLICY, ROOT

TODAY = date(2026, 12, 3)
EVERY = {"pool-llama-8b", "pool-embed", "demo-anthropic", "demo-gemini", "demo-bedrock"}
POOLS = {"pool-llama-8b", "pool-embed"}
# Records the example policy's candidates need: one per kind, per distinct route policy (chat-fallback's
# retry differs from the other routes'), per request class for quality gates (embeddings has none).
RECORDS = {"pool-llama-8b": 4, "demo-anthropic": 4, "demo-gemini": 2, "demo-bedrock": 2, "pool-embed": 1}


@pytest.fixture
def bare(tmp_path: Path) -> Path:
    """The example policy as a fresh clone has it: no keys, no evidence."""
    dst = tmp_path / "policy"
    shutil.copytree(EXAMPLE_POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    return dst


class FakeEarner:
    """Stands in for the sandboxed runs: records who was run under which routes, and passes unless told
    otherwise (its records name the real corpora's digests, as a run's do)."""

    def __init__(self, failing: set[str] | None = None) -> None:
        self.ran: list[str] = []
        self.plans: dict[str, dict[str, set[str]]] = {}
        self.failing = failing or set()

    def __call__(self, config: Path, name: str, plan: dict[str, set[str]], work: Path, time_scale: float,
                 sim_quality: float | None, today: date) -> list[Earned]:
        self.ran.append(name)
        self.plans[name] = plan
        snap = load_snapshot(config)
        dep = snap.deployments[name]
        outcome = "fail" if name in self.failing else "pass"
        out = []
        for route_name, kinds in sorted(plan.items()):
            route = snap.routes[route_name]
            if "conformance" in kinds:
                corpus = corpus_for(dep.serves)
                run = Run(dep.ref, dep.fingerprint.adapter, corpus.version, [CaseResult("plain-message", outcome)])
                out.append(Earned(route_name, run.evidence(today, demo_evidence.VALID_DAYS), corpus.digest,
                                  run.passed))
            if "quality_gate" in kinds:
                q = snap.gateway.request_classes[route.request_class].quality
                assert q is not None
                corpus = load_quality(quality_corpus(q.corpus, snap.directory))
                ev = Evaluation(dep.ref, dep.fingerprint.adapter, route.request_class, corpus.version, corpus.digest,
                                q.threshold, [CaseResult(t.id, outcome) for t in corpus.tasks])
                out.append(Earned(route_name, ev.evidence(today, demo_evidence.VALID_DAYS), corpus.digest,
                                  ev.passed))
        return out


def qualified(policy: Path, today: date) -> set[str]:
    """The deployments qualified on every route that has them as a candidate."""
    snap = load_snapshot(policy, today=today)
    return {n for n, d in snap.deployments.items()
            if all(not snap.missing_evidence(r, d.ref, today) for r in snap.routes.values()
                   if any(c.deployment_name == n for c in r.candidates))}


def test_the_repository_ships_no_evidence_and_no_date_a_calendar_reaches(bare: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "policy"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.split()
    assert files and not [f for f in files if f.startswith("policy/evidence/") and f.endswith(".yaml")]
    snap = load_snapshot(bare)  # the dates the gateway acts on: evidence expiry, retirement
    assert not snap.evidence and all(d.retire_at is None for d in snap.deployments.values())


def test_a_bare_policy_wants_both_kinds_for_every_simulated_candidate(bare: Path) -> None:
    snap = load_snapshot(bare)
    wanted = demo_evidence.wanted(snap, EVERY, TODAY)
    assert {n: sum(len(k) for k in plan.values()) for n, plan in wanted.items()} == RECORDS
    # Routes with one policy share records: chat-anthropic's and chat-default's are chat-default's too.
    assert wanted["demo-anthropic"] == {"chat-anthropic": {"conformance", "quality_gate"},
                                        "chat-fallback": {"conformance", "quality_gate"}}
    assert wanted["pool-embed"] == {"embed-default": {"conformance"}}  # its class declares no quality gate
    # Only what `llmgw up` simulates: with real engines (or none), the pool's candidate is its operator's.
    assert demo_evidence.simulated_by_up(snap, "sim", True) == EVERY
    assert demo_evidence.simulated_by_up(snap, "none", True) == EVERY - POOLS
    assert demo_evidence.simulated_by_up(snap, "sim", False) == POOLS


def test_earned_records_qualify_and_a_second_call_earns_nothing(bare: Path) -> None:
    runner = FakeEarner()
    written = demo_evidence.ensure(bare, EVERY, today=TODAY, earner=runner)
    assert sorted(runner.ran) == sorted(EVERY) and len(written) == sum(RECORDS.values())
    assert qualified(bare, TODAY) == EVERY
    gate = yaml.safe_load((bare / "evidence/demo-gemini-quality-gate-chat-gemini.yaml").read_text())
    assert gate["source"] == "llmgw evaluate" and gate["score"] == 1.0 and gate["request_class"] == "read_only_chat"
    assert gate["expires_at"] == (TODAY + timedelta(days=demo_evidence.VALID_DAYS)).isoformat()
    assert demo_evidence.ensure(bare, EVERY, today=TODAY, earner=runner) == []
    assert len(runner.ran) == len(EVERY)


def test_a_candidate_it_does_not_simulate_gets_nothing(bare: Path) -> None:
    runner = FakeEarner()
    demo_evidence.ensure(bare, EVERY - {"pool-llama-8b"}, today=TODAY, earner=runner)
    assert "pool-llama-8b" not in runner.ran
    assert qualified(bare, TODAY) == EVERY - {"pool-llama-8b"}


def test_records_are_earned_again_before_they_expire(bare: Path) -> None:
    runner = FakeEarner()
    demo_evidence.ensure(bare, EVERY, today=TODAY, earner=runner)
    later = TODAY + timedelta(days=demo_evidence.VALID_DAYS - demo_evidence.RENEW_DAYS)  # due now
    assert demo_evidence.wanted(load_snapshot(bare), EVERY, later) == demo_evidence.wanted(load_snapshot(bare), EVERY,
                                                                                           TODAY - timedelta(days=400))
    demo_evidence.ensure(bare, EVERY, today=later, earner=runner)
    assert len(runner.ran) == 2 * len(EVERY)
    assert qualified(bare, later + timedelta(days=80)) == EVERY


def test_two_years_ahead_the_demo_still_qualifies(bare: Path) -> None:
    ahead = date.today() + timedelta(days=730)
    demo_evidence.ensure(bare, EVERY, today=ahead, earner=FakeEarner())
    assert qualified(bare, ahead) == EVERY


def test_the_cache_serves_the_same_record_and_nothing_else(bare: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = FakeEarner()
    demo_evidence.ensure(bare, EVERY, today=TODAY, cache=cache, earner=first)
    assert len(first.ran) == len(EVERY) and len(list(cache.glob("*.yaml"))) == sum(RECORDS.values())
    again = tmp_path / "again"
    shutil.copytree(EXAMPLE_POLICY, again, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    # A price change voids a record (its basis): that one is earned again, the others come from the cache.
    path = again / "deployments/demo-gemini.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["prices"]["version"] = "2099-01"
    path.write_text(yaml.safe_dump(doc))
    second = FakeEarner()
    demo_evidence.ensure(again, EVERY, today=TODAY, cache=cache, earner=second)
    assert second.ran == ["demo-gemini"]
    assert qualified(again, TODAY) == EVERY


def test_a_failing_run_writes_its_record_and_stops_the_start(bare: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    failing = r"evidence failed for demo-bedrock \(conformance on chat-bedrock: plain-message: "  # names the case
    with pytest.raises(RuntimeError, match=failing):
        demo_evidence.ensure(bare, EVERY, today=TODAY, cache=cache, earner=FakeEarner(failing={"demo-bedrock"}))
    record = yaml.safe_load((bare / "evidence/demo-bedrock-conformance-chat-bedrock.yaml").read_text())
    assert record["result"] == "fail"
    gate = yaml.safe_load((bare / "evidence/demo-bedrock-quality-gate-chat-bedrock.yaml").read_text())
    assert gate["result"] == "fail" and gate["score"] == 0.0
    assert not (cache / "demo-bedrock-conformance-chat-bedrock.yaml").exists()  # a failure is never reused
    assert "demo-bedrock" not in qualified(bare, TODAY)


def test_a_record_dated_in_the_future_qualifies_nothing_and_is_not_reused(bare: Path, tmp_path: Path) -> None:
    """Records made under a clock that ran ahead (a cache filled two years ahead, then the clock put
    right) prove nothing yet: the candidate is not qualified, and the cache's records are earned again."""
    cache = tmp_path / "cache"
    ahead = TODAY + timedelta(days=730)
    demo_evidence.ensure(bare, EVERY, today=ahead, cache=cache, earner=FakeEarner())
    assert qualified(bare, ahead) == EVERY
    assert qualified(bare, TODAY) == set()  # dated two years from now: fail closed
    assert qualified(bare, ahead - timedelta(days=1)) == EVERY  # a day's grace: UTC dates, local today
    again = tmp_path / "again"
    shutil.copytree(EXAMPLE_POLICY, again, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    runner = FakeEarner()
    demo_evidence.ensure(again, EVERY, today=TODAY, cache=cache, earner=runner)
    assert sorted(runner.ran) == sorted(EVERY)  # none of the future-dated records reused
    assert qualified(again, TODAY) == EVERY
