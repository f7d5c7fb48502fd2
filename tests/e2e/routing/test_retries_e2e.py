"""Retries per request (invariant 6): Envoy's router retries only what ext_proc allowed for this
request, to another engine, within the one deadline; never after 400, never a request with effects
that has no Idempotency-Key. Engine faults are queued on the simulated engines themselves."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import POLICY, stamp_evidence, start_stack
from tests.e2e.routing.test_e2e_served_path import clear_engine_logs, engine_log
from tests.helpers import assert_contract_error, chat_body, request, unique_marker

pytestmark = pytest.mark.e2e
WRITER = "sk-test-retry-writer-0123456789"  # acme, granted the write effect
TOOL = [{"type": "function", "function": {"name": "update_ticket"}}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("retries")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    (policy / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"id": "acme-writer", "tenant": "acme", "sha256": hashlib.sha256(WRITER.encode()).hexdigest(),
         "effects": ["write"]}]}))
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["retry"] = {"attempts": 1, "eligible_failures": ["connect_before_send", "unavailable", "rate_limited"],
                      "requires": "read_only_or_idempotency_key"}
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    stamp_evidence(policy, "pool-llama-8b")  # under the route's new retry policy
    s = start_stack(tmp / "state", policy)
    yield s
    s.stop()


def faults(stack: Stack, fault: str | None, engines: list[str] | None = None) -> None:
    for url in engines or stack.engine_urls():
        request(f"{url}/admin/faults", "DELETE")
        if fault:
            request(f"{url}/admin/faults", "POST", {"fault": fault, "count": 1})


@pytest.fixture(autouse=True)
def no_faults_left(gw: Stack) -> Iterator[None]:
    yield
    faults(gw, None)  # a fault queued but not met must not reach the next test


def chat(stack: Stack, body: dict[str, Any] | None = None, key: str = WRITER, **headers: str) -> Any:
    return request(f"{stack.url}/v1/chat/completions", "POST", body or chat_body(max_tokens=4),
                   headers={"authorization": f"Bearer {key}", **headers})


def test_a_503_before_the_first_byte_is_retried_on_another_engine(gw: Stack) -> None:
    engines = gw.engine_urls("engine-pool")
    seen = None
    # Until a request's first attempt meets the fault. The engine faulted alternates: these prompts share
    # their first characters, so the picker's prefix affinity sends each to the engine the last one went
    # to, and a fault always on the same engine could be missed every time (a clean-clone CI run was).
    for i in range(8):
        faulted, other = engines[i % 2], engines[1 - i % 2]
        faults(gw, "status=503", [faulted])
        faults(gw, None, [other])
        clear_engine_logs(gw)
        r = chat(gw, chat_body(max_tokens=4, content=f"retry me {i} {unique_marker('r')}"))
        assert r.status == 200, r.body
        if r.headers["x-llmgw-attempts"] == "2":
            seen = r
            break
    assert seen is not None, "no first attempt ever met the fault"
    log = engine_log(gw)
    assert [(e["engine"], e["status"]) for e in log] == [(faulted, 503), (other, 200)]
    assert seen.headers["x-llmgw-deployment"] == "pool-llama-8b"


def test_a_request_with_effects_and_no_idempotency_key_is_not_retried(gw: Stack) -> None:
    faults(gw, "status=503")
    clear_engine_logs(gw)
    r = chat(gw, chat_body(max_tokens=4, tools=TOOL))
    assert_contract_error(r, 502, "upstream_error")
    assert r.headers["x-llmgw-attempts"] == "1"
    assert len(engine_log(gw)) == 1
    # The same request with an Idempotency-Key may be retried: once (the route's attempts), on the other engine.
    faults(gw, "status=503")
    clear_engine_logs(gw)
    r = chat(gw, chat_body(max_tokens=4, tools=TOOL), **{"idempotency-key": f"k-{time.time_ns()}"})
    assert_contract_error(r, 502, "upstream_error")  # both engines failed once: one retry, no more
    assert r.headers["x-llmgw-attempts"] == "2" and len(engine_log(gw)) == 2


def test_400_is_never_retried(gw: Stack) -> None:
    faults(gw, "status=400")
    clear_engine_logs(gw)
    r = chat(gw)
    assert_contract_error(r, 400, "invalid_request")
    assert len(engine_log(gw)) == 1


def test_clients_cannot_ask_envoy_for_retries(gw: Stack) -> None:
    faults(gw, "status=503")
    clear_engine_logs(gw)
    r = chat(gw, chat_body(max_tokens=4, tools=TOOL), **{"x-envoy-retry-on": "5xx", "x-envoy-max-retries": "5"})
    assert_contract_error(r, 502, "upstream_error")
    assert len(engine_log(gw)) == 1
