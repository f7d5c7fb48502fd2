"""Degraded mode instead of open (issue 16, part 3): when no qualified, policy-equivalent candidate
exists, a route answers with its declared degraded answer - a fixed response, or a named cheaper route
whose candidates pass the same checks - marked `x-llmgw-degraded` and in the ledger; without one, or
when the degraded route qualifies nothing either, 503 no_qualified_route stays."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, start_stack
from tests.helpers import assert_contract_error, chat_body, request

KEY = DEMO_KEYS["acme"]
FIXED = "The assistant is unavailable right now; please try again shortly."


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def copy_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    return dst


# --- configuration ---------------------------------------------------------------------------------

CONFIG_CASES = [
    ({"response": FIXED, "route": "chat-default"}, "exactly one of `response` or `route`"),
    ({}, "exactly one of `response` or `route`"),
    ({"route": "no-such-route"}, "'no-such-route' is not another route"),
    ({"route": "chat-gemini"}, "not a cheaper route"),  # Gemini's tokens cost more than the pool's
]


@pytest.mark.parametrize(("degraded", "error"), CONFIG_CASES, ids=[e for _, e in CONFIG_CASES])
def test_a_degraded_answer_is_one_thing_and_a_degraded_route_is_cheaper(tmp_path: Path, degraded: dict[str, Any],
                                                                        error: str) -> None:
    policy = copy_policy(tmp_path)
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(degraded=degraded))
    with pytest.raises(ConfigError, match=error):
        load_snapshot(policy)


def test_a_degraded_route_degrades_one_step_only(tmp_path: Path) -> None:
    policy = copy_policy(tmp_path)
    edit(policy / "routes/chat-gemini.yaml", lambda d: d.update(degraded={"route": "chat-default"}))
    edit(policy / "routes/chat-anthropic.yaml", lambda d: d.update(degraded={"route": "chat-gemini"}))
    with pytest.raises(ConfigError, match="degrades to a route itself"):
        load_snapshot(policy)


# --- through the gateway -----------------------------------------------------------------------------


def degraded_policy(root: Path) -> Path:
    """Both hosted models withdrawn: chat-anthropic answers a fixed text, chat-gemini moves to the
    pool's route, chat-bedrock (its own provider withdrawn too) declares nothing."""
    policy = copy_policy(root)
    for dep in ("demo-anthropic", "demo-gemini", "demo-bedrock"):
        edit(policy / f"deployments/{dep}.yaml", lambda d: d.update(withdrawn=True))
    edit(policy / "routes/chat-anthropic.yaml", lambda d: d.update(degraded={"response": FIXED}))
    edit(policy / "routes/chat-gemini.yaml", lambda d: d.update(degraded={"route": "chat-default"}))
    # The pool's route takes no confidential data here: a confidential request has nowhere to degrade to.
    edit(policy / "routes/chat-default.yaml", lambda d: d["candidates"][0].update(data_classes=["public", "internal"]))
    return policy


gw = module_stack("degraded", degraded_policy, simulate_providers=True)
pytestmark = pytest.mark.e2e


def provider_requests(stack: Stack) -> int:
    return sum(len(json.loads(request(f"http://{h}:{p}/admin/requests").body))
               for hosts in stack.render.providers.values() for h, p in hosts)


def test_a_fixed_degraded_answer_is_marked_released_and_reaches_no_upstream(gw: Stack) -> None:
    before = provider_requests(gw)
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-anthropic", max_tokens=8),
                {"authorization": f"Bearer {KEY}"})
    assert r.status == 200 and r.headers["x-llmgw-degraded"] == "response"
    doc = r.json()
    assert doc["choices"][0]["message"]["content"] == FIXED and doc["choices"][0]["finish_reason"] == "stop"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert (entry["termination"], entry["settlement"], entry["degraded"], entry["attempts"]) == (
        "degraded", "released", "response", [])
    assert entry.get("charged_micros", 0) == 0
    assert provider_requests(gw) == before


def test_a_fixed_degraded_answer_streams_and_speaks_each_door(gw: Stack) -> None:
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-anthropic", max_tokens=8, stream=True),
                {"authorization": f"Bearer {KEY}"})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.body.decode().splitlines()
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == FIXED
    assert r.body.decode().rstrip().endswith("data: [DONE]")
    # Anthropic's front door: the same answer as a Messages API response.
    m = request(f"{gw.url}/v1/messages", "POST", {"model": "chat-anthropic", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "hi"}]},
                {"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert m.status == 200 and m.headers["x-llmgw-degraded"] == "response"
    assert m.json()["type"] == "message" and m.json()["content"][0]["text"] == FIXED


def test_a_degraded_route_serves_under_the_same_checks(gw: Stack) -> None:
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-gemini", max_tokens=8),
                {"authorization": f"Bearer {KEY}"})
    assert r.status == 200 and r.headers["x-llmgw-degraded"] == "route:chat-default"
    assert r.headers["x-llmgw-deployment"] == "pool-llama-8b"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["route"] == "chat-gemini" and entry["degraded"] == "route:chat-default"
    assert entry["attempts"][-1]["deployment"] == "pool-llama-8b" and entry["settlement"] == "actual"
    # A data class the degraded route's candidates may not take is never served there: still 503.
    confidential = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-gemini", max_tokens=8),
                           {"authorization": f"Bearer {KEY}", "x-llmgw-data-class": "confidential"})
    err = assert_contract_error(confidential, 503, "no_qualified_route")
    assert "nor of its degraded route 'chat-default'" in err["message"]
    assert "x-llmgw-degraded" not in confidential.headers


def test_without_a_degraded_answer_it_stays_503(gw: Stack) -> None:
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-bedrock", max_tokens=8),
                {"authorization": f"Bearer {KEY}"})
    assert_contract_error(r, 503, "no_qualified_route")
    assert "x-llmgw-degraded" not in r.headers


def test_when_every_upstream_is_down_the_fixed_answer_serves_and_charges_nothing(tmp_path: Path) -> None:
    """The decision cannot see Envoy's health: it admits a request whose candidates turn out all down.
    Envoy then answers the route's fixed degraded answer (not 502), as JSON or a stream, marked and
    settled at nothing; a route without one keeps its 502."""
    policy = copy_policy(tmp_path)
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(degraded={"response": FIXED}))
    s = start_stack(tmp_path / "state", policy)
    try:
        for engine in s.engines.values():
            engine.stop()  # the pool is gone: refused connections, then no healthy host

        def ask(route: str, **kw: Any) -> Any:
            return request(f"{s.url}/v1/chat/completions", "POST", chat_body(route, max_tokens=8, **kw),
                           {"authorization": f"Bearer {KEY}"}, timeout=30)

        answers = [ask("chat-default"), ask("chat-default", stream=True)]
        time.sleep(3)  # the health checks have marked every engine down
        answers += [ask("chat-default"), ask("chat-default", stream=True)]
        for r in answers:
            assert r.status == 200 and r.headers["x-llmgw-degraded"] == "response", (r.status, r.body[:300])
            text = r.body.decode()
            assert FIXED in text and r.headers["x-request-id"] in text
            entry = ledger_of(s, r.headers["x-request-id"], "acme")
            assert (entry["termination"], entry["settlement"], entry["degraded"]) == ("degraded", "released",
                                                                                     "response")
            assert entry["charged_micros"] == 0 and entry["charged_tokens"] == 0
        assert answers[1].headers["content-type"].startswith("text/event-stream")
        assert answers[1].body.decode().rstrip().endswith("data: [DONE]")
        assert json.loads(answers[0].body)["choices"][0]["message"]["content"] == FIXED
        other = ask("chat-fallback")  # no degraded answer declared: its failure stays an error
        assert other.status >= 500 and "x-llmgw-degraded" not in other.headers
    finally:
        s.stop()
