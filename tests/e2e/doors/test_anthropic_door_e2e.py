"""The Anthropic front door (issue 13): the real `anthropic` SDK, its base URL at the gateway, through
Envoy and ext_proc, to the vLLM-shaped pool and to an Anthropic-shaped provider. The same stages run
(identity by `x-api-key`, policy, budget, routing, metering); answers, streams and errors come back in
Anthropic's shape with the contract's code inside."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of
from tests.e2e.doors.test_translated_route_e2e import azure, gw, provider, received  # noqa: F401 - fixtures
from tests.helpers import inject_fault, request, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
SEARCH = {"name": "search_docs", "description": "search the docs",  # in the demo policy's tool catalog
          "input_schema": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}


def client(stack: Stack, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0)


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_a_message_from_the_pool(stack: Stack) -> None:
    raw = client(stack).messages.with_raw_response.create(model="chat-default", max_tokens=7,
                                                          system="You are brief.", messages=ask("hello"))
    m = raw.parse()
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == 7 and m.usage.input_tokens > 0
    assert raw.headers["x-llmgw-deployment"] == "pool-llama-8b"
    assert raw.headers["x-llmgw-route-revision"] == stack.snapshot.revision
    # Metered like any chat completion: one ledger entry, the SDK's usage.
    entry = ledger_of(stack, raw.headers["x-request-id"], "acme")
    assert entry["usage"]["completion_tokens"] == 7
    assert entry["usage"]["prompt_tokens"] == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def test_a_stream_from_the_pool(stack: Stack) -> None:
    text = ""
    with client(stack).messages.stream(model="chat-default", max_tokens=9, messages=ask("stream please")) as s:
        for event in s:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        final = s.get_final_message()
    assert final.content[0].text == text and text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 9


def test_raw_stream_events_are_anthropics(stack: Stack) -> None:
    r = request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "max_tokens": 3, "stream": True,
                                                     "messages": ask("raw")}, {"x-api-key": KEY})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    kinds = [e.split("\n", 1)[0].removeprefix("event: ") for e in r.body.decode().split("\n\n") if e]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert b"[DONE]" not in r.body and b"chat.completion" not in r.body


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_from_the_pool(stack: Stack, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "chat-default", "max_tokens": 200, "tools": [SEARCH],
                          "messages": ask("use search_docs for ledger")}
    if stream:
        with client(stack).messages.stream(**kw) as s:
            deltas = sum(1 for e in s if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
            m = s.get_final_message()
        assert deltas > 1  # the arguments came split across chunks
    else:
        m = client(stack).messages.create(**kw)
    (block,) = m.content
    assert m.stop_reason == "tool_use" and block.type == "tool_use" and block.name == "search_docs"
    assert isinstance(block.input, dict) and isinstance(block.input["query"], str)  # type: ignore[index]
    # The tool's result, sent back: answered in text.
    follow = client(stack).messages.create(model="chat-default", max_tokens=8, tools=[SEARCH], messages=[
        *ask("use search_docs for ledger"), {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "found it"}]}])
    assert follow.content[0].type == "text"


def test_errors_are_anthropics_with_the_contracts_code(stack: Stack) -> None:
    with pytest.raises(anthropic.AuthenticationError) as auth:
        client(stack, "sk-wrong").messages.create(model="chat-default", max_tokens=4, messages=ask("x"))
    assert auth.value.body["error"]["code"] == "unauthenticated"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as nf:
        client(stack).messages.create(model="no-such-route", max_tokens=4, messages=ask("x"))
    assert nf.value.body["error"] == {"type": "not_found_error", "message": "no route named 'no-such-route'",  # type: ignore[index]
                                      "code": "route_not_found", "param": "model"}
    with pytest.raises(anthropic.BadRequestError) as bad:
        client(stack).messages.create(model="chat-default", max_tokens=2000, messages=ask("x"),  # Anthropic's own,
                                      service_tier="auto")  # and no hint: refused where it cannot reach
    assert bad.value.body["error"]["code"] == "unsupported_field"  # type: ignore[index]
    assert bad.value.body["error"]["param"] == "service_tier"  # type: ignore[index]
    r = request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "messages": ask("no max_tokens")},
                {"x-api-key": KEY})
    assert r.status == 400 and r.json()["error"]["param"] == "max_tokens" and r.json()["type"] == "error"
    r = request(f"{stack.url}/v1/messages", "POST", None, {"x-api-key": KEY})  # Envoy's own reply, no body
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["type"] == "error"  # Anthropic's shape, not the chat completion's (issue 27)


def test_upstream_failures_and_envoys_own_replies_are_anthropic_errors(stack: Stack) -> None:
    # custom_response's rewrite of the engine's 503 and Envoy's own timeout reply never pass the door
    # filter: they are rendered in the door's shape for the door's requests.
    marker = inject_fault(stack.engine_urls(), "status=503", count=4)
    with pytest.raises(anthropic.InternalServerError) as e:
        client(stack).messages.create(model="chat-default", max_tokens=4, messages=ask(marker))
    assert e.value.status_code == 502 and e.value.body == {  # type: ignore[comparison-overlap]
        "type": "error", "error": {"type": "api_error", "message": "the upstream is unavailable (503)",
                                   "code": "upstream_error"}}
    marker = inject_fault(stack.engine_urls(), "delay_ms=3000", count=4)
    r = request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "max_tokens": 4, "messages": ask(marker)},
                {"x-api-key": KEY, "x-llmgw-deadline-ms": "300"})
    assert r.status == 504 and r.json()["type"] == "error"
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("timeout_error", "deadline_exceeded")


def test_a_broken_stream_ends_with_an_error_event(stack: Stack) -> None:
    marker = inject_fault(stack.engine_urls(), "malformed_after=2")
    r = request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "max_tokens": 12, "stream": True,
                                                     "messages": ask(marker)}, {"x-api-key": KEY})
    events = [e for e in r.body.decode().split("\n\n") if e]
    assert events[-1].startswith("event: error") and "message_stop" not in r.body.decode()
    assert json.loads(events[-1].split("data: ", 1)[1])["error"]["code"] == "stream_interrupted"
    with pytest.raises(anthropic.APIStatusError):  # the SDK raises on it
        marker = inject_fault(stack.engine_urls(), "malformed_after=2")
        with client(stack).messages.stream(model="chat-default", max_tokens=12, messages=ask(marker)) as s:
            for _ in s:
                pass


@pytest.mark.parametrize("stream", [False, True])
def test_a_usage_count_no_engine_gives_is_the_doors_error(stack: Stack, stream: bool) -> None:
    """The pool reports a completion count that is a string: Anthropic's usage cannot carry it. The
    door answers its error (a JSON answer: the 502, status and body - the Lua door holds the headers
    until the body is read; a stream ends with the error event, never message_stop), the ledger
    charges the whole reservation, and ext_proc raised nothing (the door's translation there did,
    before it moved to Lua)."""
    marker = inject_fault(stack.engine_urls(), 'usage="many"')
    r = request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "max_tokens": 4, "stream": stream,
                                                     "messages": ask(marker)}, {"x-api-key": KEY})
    if stream:
        events = [e for e in r.body.decode().split("\n\n") if e]
        assert events[-1].startswith("event: error") and "message_stop" not in r.body.decode(), events[-2:]
        assert json.loads(events[-1].split("data: ", 1)[1])["error"]["message"] == "a token count no upstream gives"
    else:
        assert r.status == 502 and r.json()["type"] == "error" and r.json()["error"]["code"] == "upstream_error"
    entry = ledger_of(stack, r.headers["x-request-id"], "acme")
    assert entry["settlement"] == "ambiguous" and entry["charged_micros"] == entry["reserved_micros"], entry
    assert not [f.name for f in stack.logs.glob("extproc-*.log") if "Traceback" in f.read_text(errors="replace")]


DOOR_CALLS = {  # door -> (path of a JSON answer, of a stream; the body, with the text to ask; the key header)
    "anthropic": ("/v1/messages", "/v1/messages",
                  lambda text, stream: {"model": "chat-default", "max_tokens": 8, "stream": stream,
                                        "messages": ask(text)}, "x-api-key"),
    "gemini": ("/v1beta/models/chat-default:generateContent",
               "/v1beta/models/chat-default:streamGenerateContent?alt=sse",
               lambda text, stream: {"contents": [{"role": "user", "parts": [{"text": text}]}]}, "x-goog-api-key"),
}


@pytest.mark.parametrize("door", DOOR_CALLS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("idempotent", [False, True], ids=["lua-guard", "extproc-guard"])
def test_random_bytes_from_the_pool_reach_a_door_as_its_error(stack: Stack, door: str, stream: bool,
                                                              idempotent: bool) -> None:
    """The pool answers 200 with random bytes (the simulator's `garbage` fault), through the real
    Envoy, to each front door, behind either stream guard (an Idempotency-Key: ext_proc's): a JSON
    answer is the door's 502 (status and body, in its shape, charged in full: the engine answered), a
    stream ends with the door's error event - a guard that passed a chunk completing no event empty
    made the door read it as the end and let the rest through untranslated; never a Lua script error
    in Envoy's log, never a traceback in ext_proc's."""
    json_path, stream_path, body, header = DOOR_CALLS[door]
    for seed in range(6):
        marker = inject_fault(stack.engine_urls(), f"garbage={seed}")
        r = request(f"{stack.url}{stream_path if stream else json_path}", "POST", body(marker, stream),
                    {header: KEY, **({"idempotency-key": f"k-{marker}"} if idempotent else {})})
        if not stream:
            doc = r.json()
            assert r.status == 502, (seed, r.body[:200])
            assert (doc["error"]["code"] if door == "anthropic" else doc["error"]["details"][0]["reason"]) == \
                "upstream_error", (seed, doc)
            assert doc.get("type") == "error" if door == "anthropic" else doc["error"]["status"] == "UNAVAILABLE"
            entry = ledger_of(stack, r.headers["x-request-id"], "acme")
            assert entry["settlement"] == "ambiguous" and entry["charged_micros"] == entry["reserved_micros"], entry
        else:
            assert r.status == 200, (seed, r.body[:200])
            text = r.body.decode()
            last = [e for e in text.split("\r\n\r\n" if door == "gemini" else "\n\n") if e][-1]
            if door == "anthropic":
                assert last.startswith("event: error") and "message_stop" not in text, (seed, last)
            else:
                assert json.loads(last.removeprefix("data: "))["error"]["details"][0]["reason"] == \
                    "stream_interrupted", (seed, last)
    envoy = (stack.logs / "envoy.log").read_text(errors="replace")
    assert not [line for line in envoy.splitlines() if "[lua]" in line or "script log" in line], envoy[-2000:]
    assert not [f.name for f in stack.logs.glob("extproc-*.log") if "Traceback" in f.read_text(errors="replace")]


def test_credentials_where_each_sdk_puts_them(stack: Stack) -> None:
    body = {"model": "chat-default", "max_tokens": 2, "messages": ask("who am i")}
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"},
                    {"x-api-key": KEY, "authorization": f"Bearer {KEY}"}):
        assert request(f"{stack.url}/v1/messages", "POST", body, headers).status == 200, headers
    # Two different credentials: which one counts would be a guess.
    two = request(f"{stack.url}/v1/messages", "POST", body,
                  {"x-api-key": KEY, "authorization": f"Bearer {DEMO_KEYS['globex']}"})
    assert two.status == 401
    # The chat completions door takes its SDK's bearer token only: there x-api-key is just another
    # header (a client's key for something else, never forwarded).
    r = request(f"{stack.url}/v1/chat/completions", "POST", body, {"x-api-key": KEY})
    assert r.status == 401


def test_the_gateway_credential_never_reaches_the_engine(stack: Stack) -> None:
    marker = unique_marker("cred")
    assert request(f"{stack.url}/v1/messages", "POST", {"model": "chat-default", "max_tokens": 2,
                                                        "messages": ask(marker)},
                   {"x-api-key": KEY, "anthropic-version": "2023-06-01"}).status == 200
    (entry,) = [e for u in stack.engine_urls() for e in request(f"{u}/admin/requests").json()
                if marker in json.dumps(e["messages"])]
    assert not entry["api_key_present"] and "anthropic-version" not in entry["headers"]
    assert entry["path"] == "/v1/chat/completions"


def test_the_anthropic_door_reaches_the_anthropic_provider(gw: Stack, provider: str) -> None:  # noqa: F811
    with client(gw).messages.stream(model="chat-anthropic", max_tokens=6, messages=ask("to the provider")) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    (sent,) = received(provider)
    assert sent["path"] == "/v1/messages" and sent["model"] == "claude-sim-1"
