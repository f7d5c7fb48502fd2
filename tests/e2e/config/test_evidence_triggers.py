"""Re-evaluation triggers (issue 16, part 5): each voids evidence, takes the candidate out of routing,
and says why in `llmgw check` and the metrics. Static ones (price, provider quota, a policy change
touching the deployment's data classes) at every load; run-time ones (provider drift, workload shift,
SLO regression) from the ledger, written as void records; and a later failing record outranks an
earlier pass."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from extproc.config import load_snapshot
from extproc.config.schema import Evidence
from extproc.occupancy import _Fixed, families
from llmgw.ops.reevaluate import Bounds, evaluate, objectives_of, void_files
from tests.conftest import POLICY
from tests.helpers import llmgw

TODAY = date.today()


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml"))
    return dst


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def qualified(policy: Path, deployment: str) -> bool:
    """Qualified on every route that has it as a candidate."""
    snap = load_snapshot(policy)
    routes = [r for r in snap.routes.values() if any(c.deployment_name == deployment for c in r.candidates)]
    return bool(routes) and not any(snap.missing_evidence(r, snap.deployments[deployment].ref, TODAY) for r in routes)


def narrow_anthropic(p: Path) -> None:
    """demo-anthropic serves fewer classes (its candidates may not claim more than it serves)."""
    edit(p / "deployments/demo-anthropic.yaml", lambda d: d.update(data_classes=["public", "internal"]))
    for route in ("chat-anthropic", "chat-fallback"):
        edit(p / f"routes/{route}.yaml", lambda d: [c.update(data_classes=["public", "internal"])
                                                   for c in d["candidates"]])


STATIC = [  # (what `llmgw check` says, the change, whether it touches every deployment)
    ("price change (2026-12.2 -> 2027-01)",
     lambda p: edit(p / "deployments/demo-anthropic.yaml", lambda d: d["prices"].update(version="2027-01")), False),
    ("provider quota change", lambda p: edit(p / "deployments/demo-anthropic.yaml",
                                             lambda d: d["provider_quota"].update(requests_per_minute=1)), False),
    ("policy change touching its data classes", narrow_anthropic, False),
    # Redaction decides what every deployment receives: all their evidence is void.
    ("policy change touching its data classes",
     lambda p: edit(p / "gateway.yaml", lambda d: d["redaction"].update(from_data_class="confidential")), True),
]


@pytest.mark.parametrize(("reason", "change", "everyone"), STATIC, ids=["price", "quota", "data classes", "redaction"])
def test_a_static_trigger_voids_the_evidence_and_the_candidate_leaves_routing(
        policy: Path, reason: str, change: Callable[[Path], None], everyone: bool) -> None:
    assert qualified(policy, "demo-anthropic")
    change(policy)
    assert not qualified(policy, "demo-anthropic")
    snap = load_snapshot(policy)
    why = snap.voided[snap.deployments["demo-anthropic"].ref]
    assert {w.split(": ", 1)[0] for w in why} == {"conformance", "quality_gate"}
    assert all(reason in w for w in why), why
    out = llmgw("check", str(policy))
    assert "route chat-anthropic: candidate demo-anthropic: NOT ELIGIBLE" in out.stdout and reason in out.stdout
    assert qualified(policy, "pool-llama-8b") is not everyone  # only what the change touches is voided


def test_a_later_failing_record_outranks_an_earlier_pass(policy: Path) -> None:
    rec = yaml.safe_load((policy / "evidence/demo-gemini-conformance-chat-gemini.yaml").read_text())
    later = {**rec, "result": "fail", "recorded_at": (TODAY + timedelta(days=1)).isoformat(), "cases": [],
             "earned_at": (datetime.now(UTC) + timedelta(days=1)).isoformat()}
    (policy / "evidence/demo-gemini-conformance-rerun.yaml").write_text(yaml.safe_dump(later))
    assert not qualified(policy, "demo-gemini")
    # An old failure the pass superseded; and one earned the same day, a second before the pass.
    earlier = {**later, "recorded_at": "2026-01-01", "earned_at": "2026-01-01T09:00:00+00:00"}
    (policy / "evidence/demo-gemini-conformance-rerun.yaml").write_text(yaml.safe_dump(earlier))
    assert qualified(policy, "demo-gemini")
    passed = Evidence.model_validate(rec).moment()
    earlier = {**later, "recorded_at": passed.date().isoformat(),
               "earned_at": (passed - timedelta(seconds=1)).isoformat()}
    (policy / "evidence/demo-gemini-conformance-rerun.yaml").write_text(yaml.safe_dump(earlier))
    assert qualified(policy, "demo-gemini")


def entry(dep: str, t: float, request_class: str = "chat", status: int = 200, termination: str = "complete",
          stream: bool = True, first_token_ms: float = 100.0, prompt: int = 500) -> dict[str, Any]:
    """A ledger entry; its headers came at 5 ms whatever its first token's time (as an engine's do:
    before queueing and prefill), so a trigger judging the headers finds nothing slow."""
    return {"time": t, "request_class": request_class, "termination": termination, "stream": stream,
            "first_byte_ms": 5.0, "first_token_ms": first_token_ms, "duration_ms": first_token_ms * 5,
            "usage": {"prompt_tokens": prompt},
            "attempts": [{"deployment": dep, "status": status}]}


def test_run_time_triggers_fire_beyond_their_bounds_and_not_before() -> None:
    bounds = Bounds(max_failure_share=0.05, ttft_p95_ms=1000, min_requests=50)
    base = [entry("a", i) for i in range(100)]
    assert evaluate(base, base, bounds) == []
    broken = [entry("a", i, status=502 if i < 10 else 200, termination="upstream_error" if i < 10 else "complete")
              for i in range(100)]
    (drift,) = evaluate(broken, base, bounds)
    assert (drift.deployment, drift.trigger) == ("a", "provider_drift") and "10.0% of 100" in drift.reason
    slow = [entry("a", i, first_token_ms=2000 if i < 10 else 100) for i in range(100)]
    (slo,) = evaluate(slow, base, bounds)
    assert slo.trigger == "slo_regression" and "TTFT p95 2000 ms" in slo.reason
    shifted = [entry("a", i, request_class="agent" if i < 40 else "chat") for i in range(100)]
    (mix,) = evaluate(shifted, base, bounds)
    assert mix.trigger == "workload_shift" and "moved by 0.40" in mix.reason
    longer = [entry("a", i, prompt=1000) for i in range(100)]
    (length,) = evaluate(longer, base, bounds)
    assert length.trigger == "workload_shift" and "prompt p95 1000" in length.reason
    assert evaluate(broken[:49], base, bounds) == []  # too few requests decide nothing


def test_a_class_below_its_objective_is_an_slo_regression() -> None:
    """The class's objective from the configuration (not a flag): 10% of its streams past its TTFT
    limit is below an attainment of 95%; another class's answers are not judged on it."""
    objectives = {"chat": (1000.0, None, 0.95)}
    bounds = Bounds(min_requests=50, objectives=objectives)
    held = [entry("a", i, first_token_ms=2000 if i < 4 else 100) for i in range(100)]  # 96% within
    assert evaluate(held, held, bounds) == []
    slow = [entry("a", i, first_token_ms=2000 if i < 10 else 100) for i in range(100)]
    (finding,) = evaluate(slow, slow, bounds)
    assert finding.trigger == "slo_regression" and finding.reason == ("chat: 90.0% of 100 answers within its "
                                                                      "objective (at least 95%)")
    other = [entry("a", i, request_class="batch", first_token_ms=2000) for i in range(100)]
    assert evaluate(other, other, bounds) == []
    assert objectives_of(load_snapshot(POLICY).gateway)["read_only_chat"] == (1000, 30000, 0.95)


def test_a_void_record_takes_the_candidate_out_and_the_metrics_say_so(policy: Path) -> None:
    snap = load_snapshot(policy)
    from llmgw.ops.reevaluate import Finding

    fired = datetime.now(UTC)
    void_files([Finding("demo-bedrock", "provider_drift", "12.0% of 80 answers failed or broke (bound 5%)")],
               dict(snap.deployments), policy, fired)
    assert not qualified(policy, "demo-bedrock") and qualified(policy, "demo-anthropic")
    snap = load_snapshot(policy)
    assert "provider drift: 12.0% of 80 answers" in " ".join(snap.voided[snap.deployments["demo-bedrock"].ref])
    registry = CollectorRegistry()
    registry.register(_Fixed(families(snap, None, False)))
    assert 'llmgw_evidence_voided{deployment="demo-bedrock"} 2.0' in generate_latest(registry).decode()
    # Evidence earned after the trigger counts again, the same day too: by the moment, not the day.
    for kind in ("conformance", "quality-gate"):
        path = policy / f"evidence/demo-bedrock-{kind}-chat-bedrock.yaml"
        edit(path, lambda d: d.update(earned_at=(fired - timedelta(seconds=1)).isoformat()))
    assert not qualified(policy, "demo-bedrock")  # earned a second before it fired: still void
    for kind in ("conformance", "quality-gate"):
        path = policy / f"evidence/demo-bedrock-{kind}-chat-bedrock.yaml"
        edit(path, lambda d: d.update(earned_at=(fired + timedelta(seconds=1)).isoformat()))
    assert qualified(policy, "demo-bedrock")


def test_the_reevaluate_command_reads_the_ledger_and_voids_what_drifted(policy: Path) -> None:
    """The command end to end: ledger entries in a real store, a void record written, the candidate out."""
    import json
    import time

    import redis

    from extproc.store import ledger_key
    from tests.conftest import valkey_url

    url = valkey_url().rsplit("/", 1)[0] + "/8"
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()
    try:
        now = time.time()
        for i in range(60):  # the last half minute (after its evidence was earned): 10 of 60 Bedrock answers failed
            e = entry("demo-bedrock", now - 30 + i / 2, status=502 if i < 10 else 200,
                      termination="upstream_error" if i < 10 else "complete")
            record = {k: v for k, v in e.items() if k in ("time", "request_class", "stream")}
            outcome = {k: v for k, v in e.items() if k not in record}
            client.xadd(ledger_key("acme"), {"record": json.dumps(record), "outcome": json.dumps(outcome)})
        dry = llmgw("evidence", "reevaluate", "--config", str(policy), "--store-url", url, "--dry-run")
        assert dry.returncode == 1 and "demo-bedrock: provider_drift: 16.7% of 60" in dry.stdout
        assert qualified(policy, "demo-bedrock")  # a dry run writes nothing
        run = llmgw("evidence", "reevaluate", "--config", str(policy), "--store-url", url)
        assert run.returncode == 1 and "wrote" in run.stdout
        assert not qualified(policy, "demo-bedrock") and qualified(policy, "pool-llama-8b")
        quiet = llmgw("evidence", "reevaluate", "--config", str(policy), "--store-url", url,
                      "--max-failure-share", "0.5")
        assert quiet.returncode == 0 and "no trigger fired" in quiet.stdout
    finally:
        client.flushdb()
