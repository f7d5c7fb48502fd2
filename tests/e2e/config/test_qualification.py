"""Qualification (invariant 2 and the context window): only candidates with passing evidence for the
exact fingerprint, in a region the tenant allows, serving the data class, not withdrawn or retired, and
large enough, are ever dispatched to."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.bounds import bound_of
from extproc.chat import prompt_bytes
from extproc.config import load_snapshot
from extproc.contract import ErrorCode, GatewayError
from extproc.corpora import quality_corpus
from extproc.exchange import Exchange, Identity
from extproc.reservation import Held
from extproc.stages.route import PlanRequest, RouteSelection, tenant_salts
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, repin, start_stack
from tests.helpers import assert_contract_error, chat_body, request


def policy_copy(tmp_path: Path, edit: Callable[[Path], None] | None = None) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    if edit:
        edit(dst)
    return dst


def yaml_edit(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc))


def route(policy: Path, body: dict[str, Any], tenant: str = "acme", data_class: str = "internal",
          held: Held | None = None) -> Exchange:
    snap = load_snapshot(policy)
    ex = Exchange(snapshot=snap, cache_salts=tenant_salts("s", snap.gateway.tenants), body=body,
                  identity=Identity(tenant, "k", "api_key"), data_class=data_class, route=snap.routes[body["model"]],
                  held=held)
    asyncio.run(plan_of(ex))
    return ex


async def plan_of(ex: Exchange) -> None:
    """The route stage's plan and its request (no admission: every candidate has room)."""
    await RouteSelection().run(ex)
    await PlanRequest().run(ex)


def refusal(policy: Path, body: dict[str, Any] | None = None, **kw: str) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        route(policy, body or chat_body(), **kw)
    return e.value


EVIDENCE = "evidence/pool-llama-8b-quality-gate-chat-default.yaml"
CONFORMANCE = "evidence/pool-llama-8b-conformance-chat-default.yaml"
QUALITY = quality_corpus("general", Path("."))


def void_file(p: Path, trigger: str, recorded_at: str) -> None:
    (p / "evidence/voids").mkdir(parents=True, exist_ok=True)
    ref = load_snapshot(p).deployments["pool-llama-8b"].ref
    (p / f"evidence/voids/{trigger}.yaml").write_text(yaml.safe_dump(
        {"deployment_ref": ref, "trigger": trigger, "reason": "test", "recorded_at": recorded_at}))


@pytest.mark.parametrize(("why", "edit"), [
    ("no evidence", lambda p: shutil.rmtree(p / "evidence")),
    ("one kind missing", lambda p: (p / EVIDENCE).unlink()),
    ("failed gate", lambda p: yaml_edit(p / EVIDENCE, lambda d: d.update(result="fail"))),
    ("expired", lambda p: yaml_edit(p / EVIDENCE, lambda d: d.update(expires_at="2020-01-01"))),
    ("another fingerprint", lambda p: yaml_edit(p / EVIDENCE, lambda d: d.update(
        deployment_ref="pool-llama-8b@sha256:" + "0" * 64))),
    ("tenant residency", lambda p: yaml_edit(p / "gateway.yaml",
                                             lambda d: d["tenants"]["acme"].update(regions=["us"]))),
    ("withdrawn", lambda p: yaml_edit(p / "deployments/pool-llama-8b.yaml", lambda d: d.update(withdrawn=True))),
    ("retired", lambda p: yaml_edit(p / "deployments/pool-llama-8b.yaml", lambda d: d.update(retire_at="2020-01-01"))),
    # Evidence bound to what earned it (invariant 17).
    ("bound to nothing", lambda p: yaml_edit(p / CONFORMANCE, lambda d: d.pop("basis"))),
    ("another corpus", lambda p: yaml_edit(p / CONFORMANCE, lambda d: d["basis"].update(corpus_digest="0" * 16))),
    ("another quality corpus", lambda p: yaml_edit(p / EVIDENCE, lambda d: d["basis"].update(corpus_digest="0" * 16))),
    ("other shape code", lambda p: yaml_edit(p / CONFORMANCE, lambda d: d["basis"].update(shape_digest="0" * 16))),
    ("another route policy", lambda p: yaml_edit(p / "routes/chat-default.yaml", lambda d: d["retry"].update(
        eligible_failures=["connect_before_send", "rate_limited"]))),
    ("a fallback policy change", lambda p: yaml_edit(p / "routes/chat-default.yaml", lambda d: d.update(
        fallback={"enabled": False}))),
    ("a gate of another class", lambda p: yaml_edit(p / EVIDENCE, lambda d: d.update(request_class="other"))),
    ("a gate not graded", lambda p: yaml_edit(p / EVIDENCE, lambda d: d.pop("score"))),
    ("threshold above its score", lambda p: (yaml_edit(p / EVIDENCE, lambda d: d.update(score=0.85)), yaml_edit(
        p / "gateway.yaml", lambda d: d["request_classes"]["read_only_chat"]["quality"].update(threshold=0.9)))),
    ("another quality corpus named", lambda p: (shutil.copy(QUALITY, p / "tasks.yaml"), yaml_edit(
        p / "gateway.yaml", lambda d: d["request_classes"]["read_only_chat"]["quality"].update(corpus="tasks.yaml")),
        yaml_edit(p / "tasks.yaml", lambda d: d["tasks"].pop()))),
    ("an engine that differs", lambda p: void_file(p, "engine_mismatch", "2020-01-01")),
    ("a run-time trigger", lambda p: void_file(p, "provider_drift", "2099-01-01")),
])
def test_unqualified_candidates_are_never_chosen(tmp_path: Path, why: str, edit: Callable[[Path], None]) -> None:
    err = refusal(policy_copy(tmp_path, edit))
    assert err.code is ErrorCode.NO_QUALIFIED_ROUTE, why
    assert err.status == 503


def test_a_run_time_trigger_voids_only_records_earned_before_it_an_engine_mismatch_all(tmp_path: Path) -> None:
    """A provider-drift void dated before the records leaves them standing (they were earned after it);
    an engine mismatch is about the engine now, so it voids every record while it exists."""
    ex = route(policy_copy(tmp_path / "a", lambda p: void_file(p, "provider_drift", "2020-01-01")), chat_body())
    assert ex.deployment is not None
    err = refusal(policy_copy(tmp_path / "b", lambda p: void_file(p, "engine_mismatch", "2020-01-01")))
    assert err.code is ErrorCode.NO_QUALIFIED_ROUTE and "evidence" in err.message


def test_the_demo_policy_qualifies(tmp_path: Path) -> None:
    ex = route(policy_copy(tmp_path), chat_body())
    assert ex.deployment is not None and ex.deployment.deployment == "pool-llama-8b"


def test_size_alone_is_context_length_exceeded(tmp_path: Path) -> None:
    err = refusal(policy_copy(tmp_path), chat_body(max_tokens=131_072))
    assert err.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and err.status == 400


def test_size_and_another_reason_is_no_qualified_route(tmp_path: Path) -> None:
    err = refusal(policy_copy(tmp_path, lambda p: shutil.rmtree(p / "evidence")), chat_body(max_tokens=131_072))
    assert err.code is ErrorCode.NO_QUALIFIED_ROUTE


def test_a_candidate_takes_only_its_prompt_size_range(tmp_path: Path) -> None:
    # The bound of "hello" is 5 bytes + 8 of template: 13 tokens.
    edit = lambda lo, hi: lambda p: yaml_edit(p / "routes/chat-default.yaml", lambda d: d["candidates"][0].update(  # noqa: E731
        min_prompt_tokens=lo, max_prompt_tokens=hi))
    route(policy_copy(tmp_path / "a", edit(13, 13)), chat_body())
    err = refusal(policy_copy(tmp_path / "b", edit(0, 12)), chat_body())
    assert err.code is ErrorCode.NO_QUALIFIED_ROUTE and "prompt_size" in err.message  # not a 400: a gap in ranges
    assert refusal(policy_copy(tmp_path / "c", edit(14, None)), chat_body()).code is ErrorCode.NO_QUALIFIED_ROUTE


def test_the_bound_counts_bytes_templates_and_max_tokens(tmp_path: Path) -> None:
    # Window 131,072: 8 tokens of template for one message; 1,000 max_tokens; the rest is prompt bytes.
    fits = 131_072 - 8 - 1000
    route(policy_copy(tmp_path), chat_body(content="x" * fits, max_tokens=1000))
    assert refusal(policy_copy(tmp_path / "b"), chat_body(content="x" * (fits + 1), max_tokens=1000)).code \
        is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert prompt_bytes(chat_body(content="é")) == 2  # UTF-8 bytes, not characters
    assert prompt_bytes({"messages": [], "tools": [{"type": "function"}]}) > 0  # tool schemas are prompt too


def _upstream(ex: Exchange) -> dict[str, Any]:
    assert ex.upstream_body is not None
    doc: dict[str, Any] = json.loads(ex.upstream_body)
    return doc


def test_the_engine_is_told_the_completion_bound_that_was_reserved(tmp_path: Path) -> None:
    policy = policy_copy(tmp_path)
    # No max_tokens from the client: the route's cap (what the reservation counted) goes upstream, so
    # the engine cannot generate past the reservation (invariant 3).
    assert _upstream(route(policy, chat_body()))["max_tokens"] == 4096
    assert _upstream(route(policy, chat_body(max_tokens=7)))["max_tokens"] == 7
    assert _upstream(route(policy, chat_body(max_completion_tokens=9)))["max_completion_tokens"] == 9


def test_a_prompt_redaction_made_longer_takes_the_difference_from_max_tokens(tmp_path: Path) -> None:
    policy = policy_copy(tmp_path)
    body = chat_body(content="x" * 100, max_tokens=50)
    snap = load_snapshot(policy)
    reserved = bound_of(snap, snap.routes["chat-default"], body, 1).prompt
    longer = chat_body(content="x" * 112, max_tokens=50)  # what redaction sent on: 12 bytes more
    held = Held(0, reserved + 50, reserved, 50, 1, "v", "{}", False)
    assert _upstream(route(policy, longer, held=held))["max_tokens"] == 38  # prompt + completion <= reserved
    assert _upstream(route(policy, body, held=held))["max_tokens"] == 50
    with pytest.raises(GatewayError) as e:
        route(policy, chat_body(content="x" * 200, max_tokens=50), held=held)
    assert e.value.code is ErrorCode.INVALID_REQUEST


def test_stale_evidence_is_reported_by_check(tmp_path: Path) -> None:
    p = policy_copy(tmp_path, lambda p: yaml_edit(p / "deployments/pool-llama-8b.yaml",
                                                  lambda d: d["fingerprint"].update(precision="fp8")))
    repin(p, "pool-llama-8b")
    snap = load_snapshot(p)
    assert any("matches no current fingerprint" in w for w in snap.warnings)
    assert refusal(p).code is ErrorCode.NO_QUALIFIED_ROUTE  # a new fingerprint needs new evidence


# -- end to end: an unqualified candidate is never dispatched to ---------------------------------

@pytest.fixture
def unqualified_stack(tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(tmp_path / "state", policy_copy(tmp_path, lambda p: shutil.rmtree(p / "evidence")))
    yield s
    s.stop()


@pytest.mark.e2e
def test_no_evidence_no_dispatch(unqualified_stack: Stack) -> None:
    r = request(f"{unqualified_stack.url}/v1/chat/completions", "POST", chat_body(),
                {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    err = assert_contract_error(r, 503, "no_qualified_route")
    assert "evidence" in err["message"]
    assert all(request(f"{u}/admin/requests").json() == [] for u in unqualified_stack.engine_urls())


@pytest.mark.e2e
def test_oversized_request_is_refused_before_dispatch(stack: Stack) -> None:
    marker = f"ctx-{id(stack)}-oversized"
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=marker, max_tokens=200_000),
                {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert_contract_error(r, 400, "context_length_exceeded")
    seen = [e for u in stack.engine_urls() for e in request(f"{u}/admin/requests").json()]
    assert not any(marker in json.dumps(e["messages"]) for e in seen)
