"""The `gemini` adapter (issue 13): its translations on their own (round trips, losses, answers,
streams split anywhere, broken streams, a fuzz, errors), the simulated Gemini API it is checked
against (plain HTTP: the google-genai SDK is not installed here), and routes to that provider through
Envoy with the openai SDK as the client: JSON, a stream with usage, a tool call, the ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.contract import ErrorCode
from extproc.shapes.base import Target
from extproc.shapes.gemini.adapter import LOSS_TABLE, internal_body, native_body
from extproc.shapes.loss import Support
from extproc.shapes.registry import adapter_for
from llmgw.bench.translated import PROVIDER_PRICES, add_provider_route
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, module_provider, start_stack
from tests.e2e.doors.test_translated_route_e2e import attempts_through_the_filter
from tests.helpers import feed_hostile, request
from tests.oracles.base import UpstreamBroken
from tests.oracles.gemini import GEMINI
from tests.unit.test_adapters import chunks_of, contract_requests

MODEL = "gemini-sim-1"
KEY = "goog-sim-3f1a77"
SEARCH = {"type": "function", "function": {"name": "search_docs", "description": "docs", "parameters": {
    "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}}


def sse_docs(*docs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(d).encode() + b"\r\n\r\n" for d in docs)


# -- translations --------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(contract_requests())
def test_a_request_survives_the_round_trip_and_every_change_is_reported(body: dict[str, Any]) -> None:
    req = GEMINI.request(body, Target("r", stream=bool(body.get("stream"))))
    assert internal_body(json.loads(req.body), "r", bool(body.get("stream"))) == body
    reported = {x.field for x in req.losses}
    for field in body:
        if field not in ("model", "messages") and LOSS_TABLE.get(field) is not Support.SUPPORTED:
            assert field in reported, field


@pytest.mark.parametrize("field, value", [(f, v) for f, v in {
    "logprobs": True, "top_logprobs": 2, "logit_bias": {"1": 1}, "user": "u", "parallel_tool_calls": False,
    "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True}.items()])
def test_each_unsupported_field_is_reported_and_never_sent(field: str, value: Any) -> None:
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], field: value}
    req = GEMINI.request(body, Target("g"))
    assert (field, Support.UNSUPPORTED) in {(x.field, x.support) for x in req.losses}
    without = {k: v for k, v in body.items() if k != field}
    assert req.body == GEMINI.request(without, Target("g")).body  # nothing of it was sent


def test_a_tool_conversation_becomes_contents_with_function_parts() -> None:
    native = native_body({"model": "r", "max_tokens": 50, "temperature": 0.3, "stop": "END", "seed": 4,
                          "response_format": {"type": "json_object"}, "tools": [SEARCH],
                          "tool_choice": {"type": "function", "function": {"name": "search_docs"}}, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "find it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search_docs", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"}, {"role": "user", "content": "thanks"}]})
    assert native["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert native["contents"] == [
        {"role": "user", "parts": [{"text": "find it"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "search_docs", "args": {"query": "x"}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "search_docs", "response": {"content": "found"}}},
                                   {"text": "thanks"}]}]
    assert native["generationConfig"] == {"maxOutputTokens": 50, "temperature": 0.3, "seed": 4,
                                          "stopSequences": ["END"], "responseMimeType": "application/json"}
    assert native["toolConfig"] == {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["search_docs"]}}
    assert native["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"] == SEARCH["function"]["parameters"]


def test_an_answer_becomes_a_chat_completion_with_normalised_usage() -> None:
    doc = {"responseId": "r1", "modelVersion": "gemini-x", "candidates": [{"finishReason": "STOP", "content": {
        "role": "model", "parts": [{"text": "thinking...", "thought": True}, {"text": "Let me look."},
                                   {"functionCall": {"name": "lookup", "args": {"id": 7}}}]}}],
        "usageMetadata": {"promptTokenCount": 100, "cachedContentTokenCount": 60, "candidatesTokenCount": 9,
                          "thoughtsTokenCount": 3, "totalTokenCount": 112}}
    out = GEMINI.response(200, json.dumps(doc).encode())
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert choice["message"]["reasoning"] == "thinking..."
    assert choice["message"]["tool_calls"] == [{"id": "call_r1_0", "type": "function",
                                                "function": {"name": "lookup", "arguments": '{"id": 7}'}}]
    assert out["usage"] == {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112,
                            "prompt_tokens_details": {"cached_tokens": 60},
                            "completion_tokens_details": {"reasoning_tokens": 3}}
    blocked = GEMINI.response(200, json.dumps({"promptFeedback": {"blockReason": "SAFETY"}}).encode())
    assert blocked["choices"][0]["finish_reason"] == "content_filter"
    assert "SAFETY" in blocked["choices"][0]["message"]["refusal"]
    for broken in (b"not json", b"[]", b'{"x": 1}', b'{"candidates": [{"content": {"parts": [{"functionCall": 1}]}}]}'):
        with pytest.raises(UpstreamBroken):
            GEMINI.response(200, broken)


STREAM = sse_docs(
    {"responseId": "s1", "modelVersion": "g",
     "candidates": [{"content": {"role": "model", "parts": [{"text": "Chec"}]}}]},
    {"responseId": "s1", "candidates": [{"content": {"role": "model", "parts": [{"text": "king é"}]}}]},
    {"responseId": "s1", "candidates": [{"content": {"role": "model", "parts": [
        {"functionCall": {"name": "lookup", "args": {"id": 7}}}]}, "finishReason": "STOP"}],
     "usageMetadata": {"promptTokenCount": 20, "cachedContentTokenCount": 5, "candidatesTokenCount": 8}})


@pytest.mark.parametrize("step", [1, 3, 17, len(STREAM)])
def test_a_stream_split_anywhere_translates_to_the_same_chunks(step: int) -> None:
    t = GEMINI.stream()
    out: list[bytes] = []
    for i in range(0, len(STREAM), step):
        out += t.feed(STREAM[i:i + step])
    out += t.finish()
    chunks = chunks_of(out)
    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    body = [c for c in chunks[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == "Checking é"
    (call,) = [tc for c in body for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert call["function"] == {"name": "lookup", "arguments": '{"id": 7}'} and call["id"] == "call_s1_0"
    assert body[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-2]["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28,
                                   "prompt_tokens_details": {"cached_tokens": 5}}


def test_a_broken_stream_is_reported_not_finished() -> None:
    with pytest.raises(UpstreamBroken, match="RESOURCE_EXHAUSTED"):
        GEMINI.stream().feed(sse_docs({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "quota"}}))
    truncated = GEMINI.stream()
    truncated.feed(STREAM[: STREAM.index(b"functionCall") - 60])
    with pytest.raises(UpstreamBroken, match="without a finish reason"):
        truncated.finish()
    after = GEMINI.stream()
    with pytest.raises(UpstreamBroken, match="after the finished one"):
        after.feed(STREAM + STREAM)


response_docs = st.fixed_dictionaries({}, optional={
    "candidates": st.lists(st.fixed_dictionaries({}, optional={
        "finishReason": st.sampled_from(["STOP", "MAX_TOKENS", "SAFETY", 3]),
        "content": st.fixed_dictionaries({}, optional={"parts": st.lists(st.one_of(
            st.fixed_dictionaries({"text": st.text(max_size=4) | st.integers()}),
            st.fixed_dictionaries({"functionCall": st.fixed_dictionaries({}, optional={
                "name": st.text(max_size=3), "args": st.dictionaries(st.text(max_size=2), st.integers())})})),
            max_size=3)})}), max_size=2),
    "usageMetadata": st.dictionaries(st.sampled_from(["promptTokenCount", "candidatesTokenCount"]),
                                     st.integers(0, 9) | st.text(max_size=2)),
    "promptFeedback": st.fixed_dictionaries({"blockReason": st.sampled_from(["SAFETY", ""])}),
    "error": st.none() | st.fixed_dictionaries({"status": st.text(max_size=4)})})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64) | response_docs.map(lambda d: sse_docs(d)), max_size=10))
def test_nothing_but_upstream_broken_escapes_the_stream_translator(pieces: list[bytes]) -> None:
    feed_hostile(GEMINI.stream(), pieces)


@pytest.mark.parametrize(("status", "body", "code", "retry"), [
    (429, b'{"error":{"code":429,"message":"quota","status":"RESOURCE_EXHAUSTED"}}', ErrorCode.UPSTREAM_ERROR,
     "rate_limited"),
    (503, b'{"error":{"code":503,"message":"overloaded","status":"UNAVAILABLE"}}', ErrorCode.UPSTREAM_ERROR,
     "unavailable"),
    (400, b'{"error":{"code":400,"message":"The input token count (9) exceeds the maximum number of tokens allowed '
          b'(8).","status":"INVALID_ARGUMENT"}}', ErrorCode.CONTEXT_LENGTH_EXCEEDED, ""),
    (400, b'{"error":{"code":400,"message":"API key not valid.","status":"INVALID_ARGUMENT"}}',
     ErrorCode.UPSTREAM_ERROR, ""),
])
def test_provider_errors_map_to_the_contract(status: int, body: bytes, code: ErrorCode, retry: str) -> None:
    f = GEMINI.failure(status, body)
    assert (f.code, f.retry) == (code, retry)


def test_the_path_says_whether_it_streams_and_the_key_is_googles() -> None:
    assert adapter_for("gemini@1") is GEMINI.adapter
    assert GEMINI.endpoint(Target("gemini-2.5 pro", "k")) == (
        "/v1beta/models/gemini-2.5%20pro:generateContent", {"content-type": "application/json", "x-goog-api-key": "k"})
    assert GEMINI.endpoint(Target("g", stream=True))[0] == "/v1beta/models/g:streamGenerateContent?alt=sse"


# -- the simulated provider and the gateway in front of it -----------------------------------------

provider = module_provider("gemini", MODEL, KEY, "--max-model-len", "8192")


def generate(provider: str, body: dict[str, Any], headers: dict[str, str] | None = None, stream: bool = False,
             model: str = MODEL) -> Any:
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return request(f"{provider}/v1beta/models/{model}:{method}", "POST", body,
                   {"x-goog-api-key": KEY} if headers is None else headers)


@pytest.mark.e2e
def test_the_simulated_api_checks_what_gemini_checks(provider: str) -> None:
    ask = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 4}}
    r = generate(provider, ask)
    assert r.status == 200 and r.json()["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert r.json()["usageMetadata"]["candidatesTokenCount"] == 4
    assert generate(provider, ask, {}).json()["error"]["status"] == "INVALID_ARGUMENT"  # no key
    assert request(f"{provider}/v1beta/models/{MODEL}:generateContent?key={KEY}", "POST", ask).status == 200
    assert generate(provider, ask, model="other").json()["error"]["status"] == "NOT_FOUND"
    assert generate(provider, {"contents": []}).status == 400
    s = generate(provider, ask, stream=True)
    frames = [json.loads(e[6:]) for e in s.body.decode().split("\r\n\r\n") if e]
    assert len(frames) == 4 and frames[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert b"[DONE]" not in s.body


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, provider: str) -> Iterator[Stack]:
    import shutil

    from tests.conftest import POLICY
    tmp = tmp_path_factory.mktemp("gemini-gw")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    add_provider_route(policy, "gemini-sim", "gemini@1", "gemini-api@v1beta", MODEL, provider.removeprefix("http://"),
                       KEY, "chat-gemini")
    s = start_stack(tmp / "state", policy)
    yield s
    s.stop()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)


@pytest.mark.e2e
def test_the_openai_sdk_is_answered_by_the_gemini_provider(gw: Stack, provider: str) -> None:
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="chat-gemini", max_tokens=6, messages=[{"role": "system", "content": "brief"},
                                                     {"role": "user", "content": "hello gemini"}])
    r = raw.parse()
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    assert r.usage and r.usage.completion_tokens == 6
    assert raw.headers["x-llmgw-deployment"] == "gemini-sim"
    (sent,) = [e for e in request(f"{provider}/admin/requests").json()
               if "hello gemini" in json.dumps(e["messages"])]
    assert sent["path"] == f"/v1beta/models/{MODEL}:generateContent" and sent["api_key_present"]
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    expected = (r.usage.prompt_tokens * PROVIDER_PRICES["input_per_mtok"]
                + 6 * PROVIDER_PRICES["output_per_mtok"]) // 1_000_000
    assert abs(entry["charged_micros"] - expected) <= 1, entry  # the provider's prices


@pytest.mark.e2e
def test_a_stream_and_a_tool_call_from_the_gemini_provider(gw: Stack) -> None:
    chunks = list(sdk(gw).chat.completions.create(model="chat-gemini", max_tokens=8, stream=True,
                                                  stream_options={"include_usage": True},
                                                  messages=[{"role": "user", "content": "stream from gemini"}]))
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r = sdk(gw).chat.completions.create(model="chat-gemini", max_tokens=200, tools=[SEARCH],  # type: ignore[list-item]
                                        messages=[{"role": "user", "content": "use search_docs for gemini"}])
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "search_docs"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments)["query"], str)  # type: ignore[union-attr]


def stream_events(stack: Stack, **extra: Any) -> tuple[str, list[Any]]:
    """(request id, the data events) of a raw stream from the Gemini route."""
    r = request(f"{stack.url}/v1/chat/completions", "POST", {
        "model": "chat-gemini", "max_tokens": 5, "stream": True,
        "messages": [{"role": "user", "content": "a raw gemini stream"}], **extra},
        {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream", r.body[:200]
    data = [e.removeprefix("data: ") for e in r.body.decode().split("\n\n") if e.startswith("data: ")]
    return r.headers["x-request-id"], [d if d == "[DONE]" else json.loads(d) for d in data]


@pytest.mark.e2e
def test_a_gemini_stream_is_translated_in_envoy_and_metered(gw: Stack, provider: str) -> None:
    """A lone Gemini candidate's stream is translated by Envoy's Lua filter (extproc/direct.py), with no
    attempt-filter stream: whole, it ends with [DONE] (Gemini's stream has no end event: the usage and
    [DONE] ride on its last frame) and is metered at the provider's usage; a provider error mid-stream,
    or an end before the finish reason, reaches the client as `stream_interrupted`."""
    before = attempts_through_the_filter(gw, "gemini-sim")
    rid, events = stream_events(gw)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in json.dumps(events) and events[-2]["choices"][0]["finish_reason"] == "length"
    entry = ledger_of(gw, rid, "acme")
    assert (entry["termination"], entry["settlement"], entry["usage"]["completion_tokens"]) == ("complete", "actual", 5)
    _, events = stream_events(gw, tools=[SEARCH], max_tokens=200,
                              messages=[{"role": "user", "content": "use search_docs for a gemini stream"}])
    calls = [c for e in events[:-1] for c in e["choices"][0]["delta"].get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls] == ["search_docs"] and json.loads(calls[0]["function"]["arguments"])
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"
    for fault in ("error_after=2", "end_after=2"):
        request(f"{provider}/admin/faults", "POST", {"fault": fault, "count": 1})
        rid, events = stream_events(gw)
        assert events[-1]["error"]["code"] == "stream_interrupted" and "[DONE]" not in events, (fault, events)
        assert ledger_of(gw, rid, "acme")["termination"] == "stream_interrupted", fault
    time.sleep(1)  # long enough for the metric to show an attempt, had there been one
    assert attempts_through_the_filter(gw, "gemini-sim") == before


@pytest.mark.e2e
def test_what_gemini_cannot_carry_is_refused_before_it_is_sent(gw: Stack, provider: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        sdk(gw).chat.completions.create(model="chat-gemini", max_tokens=4, logprobs=True,
                                        messages=[{"role": "user", "content": "never sent"}])
    assert e.value.code == "unsupported_field" and e.value.param == "logprobs"  # type: ignore[attr-defined]
    assert not [x for x in request(f"{provider}/admin/requests").json() if "never sent" in json.dumps(x["messages"])]


def test_the_helper_writes_a_gemini_deployment(tmp_path: Path) -> None:
    import shutil

    from extproc.config import load_snapshot
    from tests.conftest import POLICY
    shutil.copytree(POLICY, tmp_path / "p")
    ref = add_provider_route(tmp_path / "p", "gemini-sim", "gemini@1", "gemini-api@v1beta", MODEL, "127.0.0.1:9",
                             KEY, "chat-gemini")
    snap = load_snapshot(tmp_path / "p")
    assert snap.deployments["gemini-sim"].ref == ref
    assert snap.routes["chat-gemini"].candidates[0].adapter_ref == "gemini@1"
