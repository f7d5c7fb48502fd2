"""A request Envoy answered itself because its decision never arrived (issue 27, item 4): the worker
reserved for it, then took longer than Envoy's message timeout (here a prompt of 3 MB of addresses to
redact, after the reservation, against a 200 ms timeout). Envoy answers 503 `policy_unavailable`, no
upstream sees the request, and the reservation is released at once from the access log - not left to
its lease, which would expire seconds later and charge it in full as ambiguous."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, repin
from tests.helpers import Response, assert_contract_error, request, unique_marker

pytestmark = pytest.mark.e2e


def slow_decisions(tmp: Path) -> Path:
    """The example policy with a 200 ms message timeout and a pool whose window holds a 3 MB prompt."""
    import shutil
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    dep = yaml.safe_load((policy / "deployments/pool-llama-8b.yaml").read_text())
    dep["context_window"] = 4_000_000
    (policy / "deployments/pool-llama-8b.yaml").write_text(yaml.safe_dump(dep))
    ref = repin(policy, "pool-llama-8b")
    for path in (policy / "evidence").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if str(doc.get("deployment_ref", "")).startswith("pool-llama-8b@"):
            path.write_text(yaml.safe_dump({**doc, "deployment_ref": ref}))
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["envoy"]["extproc_message_timeout_ms"] = 200
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return policy


gw = module_stack("not-processed", slow_decisions, workers=1)


def send_late(gw: Stack, marker: str, headers: dict[str, str] | None = None) -> Response:
    """A prompt of ~3 MB of addresses to redact after its reservation: the decision outlasts the timeout."""
    content = marker + " write to a.b@example.com now" * 100_000
    r = request(f"{gw.url}/v1/chat/completions", "POST", {
        "model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": content}]},
        {"authorization": f"Bearer {DEMO_KEYS['acme']}", **(headers or {})}, timeout=60)
    assert_contract_error(r, 503, "policy_unavailable")
    return r


def test_a_decision_envoy_gave_up_on_is_released_at_once(gw: Stack) -> None:
    marker = unique_marker("late")
    sent = time.monotonic()
    r = send_late(gw, marker)
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")  # waits up to 5 s: the lease is 10 s or more
    assert time.monotonic() - sent < 10
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released", entry
    assert entry["charged_micros"] == 0 and entry["reserved_micros"] > 0 and entry["attempts"] == [], entry
    arrived = [q for e in gw.engine_urls() for q in request(f"{e}/admin/requests").json()
               if marker in str(q.get("messages"))]
    assert arrived == []  # no upstream saw it


def test_a_refusal_decided_after_envoy_gave_up_says_not_processed(gw: Stack) -> None:
    """The worker goes on deciding after Envoy's 503 and refuses (the caller's 300 ms deadline ran out
    while it redacted). The caller never saw that refusal: the worker's own release and the access
    log's both write `not_processed`, so the ledger says what the caller got whichever is first."""
    r = send_late(gw, unique_marker("late-refusal"), {"x-llmgw-deadline-ms": "300"})
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released", entry
    assert entry["status"] == 503 and entry["charged_micros"] == 0 and entry["attempts"] == [], entry
