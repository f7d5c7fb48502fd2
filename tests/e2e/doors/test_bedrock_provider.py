"""The `bedrock` adapter (issue 13): its translations on their own (round trips, losses, answers, event
streams split anywhere, broken streams, a fuzz, errors, the SigV4 signature), the simulated Converse
API it is checked against (its event-stream framing read back by botocore's parser, its signature
check written from the published algorithm), and a route to that provider through Envoy with the
openai SDK as the client: JSON, a stream with usage, a tool call split across chunks, refusals, the
ledger."""

from __future__ import annotations

import json
import shutil
import ssl
import struct
import time
import urllib.request
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from botocore.eventstream import EventStreamBuffer
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from pydantic import BaseModel

from enginesim import eventstream
from enginesim.sigv4 import SignatureError, verify
from extproc.contract import ErrorCode
from extproc.shapes.base import Target
from extproc.shapes.bedrock.adapter import LOSS_TABLE, OUTPUT_TOOL, internal_body, native_body
from extproc.shapes.loss import HINT_FIELDS, Support
from extproc.shapes.registry import adapter_for, check_options
from llmgw.bench.translated import PROVIDER_PRICES, add_provider_route, add_route_of
from llmgw.local.procs import Child, free_port, python_module, wait_until
from llmgw.local.stack import Stack
from llmgw.local.tls import demo_certs, server_cert
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_provider, start_stack
from tests.e2e.doors.test_translated_route_e2e import attempts_through_the_filter
from tests.helpers import feed_hostile, request
from tests.oracles.base import UpstreamBroken
from tests.oracles.bedrock import BEDROCK
from tests.unit.test_adapters import chunks_of, contract_requests

MODEL = "anthropic.claude-sim-v1:0"  # Bedrock's model ids hold a colon: the path encodes it, the signature twice
KEY_ID, SECRET = "AKIDSIMULATED0000001", "c2ltdWxhdGVkLXNlY3JldC1rZXk"
KEY = f"{KEY_ID}:{SECRET}"
OPTIONS = {"region": "eu-central-1"}
SEARCH = {"type": "function", "function": {"name": "search_docs", "description": "docs", "parameters": {
    "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}}


def target(stream: bool = False, credential: str = KEY) -> Target:
    return Target(MODEL, credential, OPTIONS, stream)


# -- translations --------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(contract_requests())
def test_a_request_survives_the_round_trip_and_every_change_is_reported(body: dict[str, Any]) -> None:
    req = BEDROCK.request(body, target(bool(body.get("stream"))))
    lost = {x.field for x in req.losses if x.support is Support.UNSUPPORTED}
    kept = {k: v for k, v in body.items() if k not in lost}
    if "tool_choice" in lost:  # `none`: the tools go, with nothing to say they may not be called
        assert body["tool_choice"] == "none"
        kept.pop("tools", None)
    back = internal_body(json.loads(req.body), "r", bool(body.get("stream")))
    back.pop("tools", None) if "tool_choice" in lost else None
    assert back == kept
    reported = {x.field for x in req.losses}
    for field in body:
        if field not in ("model", "messages") and LOSS_TABLE.get(field) is not Support.SUPPORTED:
            assert field in reported, field


@pytest.mark.parametrize("field, value", [(f, v) for f, v in {
    "seed": 3, "logprobs": True, "top_logprobs": 2, "logit_bias": {"1": 1}, "n": 2, "frequency_penalty": 0.5,
    "response_format": {"type": "json_object"}, "parallel_tool_calls": False, "min_p": 0.1}.items()])
def test_each_unsupported_field_is_reported_and_never_sent(field: str, value: Any) -> None:
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], field: value}
    req = BEDROCK.request(body, target(credential=""))
    assert (field, Support.UNSUPPORTED) in {(x.field, x.support) for x in req.losses}
    without = {k: v for k, v in body.items() if k != field}
    assert req.body == BEDROCK.request(without, target(credential="")).body  # nothing of it was sent


PLAN = {"type": "object", "required": ["day", "owner"], "additionalProperties": False,
        "properties": {"day": {"type": "string"}, "owner": {"type": "string"}}}
AS_PLAN = {"type": "json_schema", "json_schema": {"name": "plan", "strict": True, "schema": PLAN}}


@pytest.mark.parametrize(("tools", "choice", "converse_choice"), [
    ([], None, {"tool": {"name": OUTPUT_TOOL}}),  # the answer must be given as the schema asks
    ([SEARCH], None, {"any": {}}),  # the answer, or a call of the caller's tools
    ([SEARCH], "auto", {"any": {}}),
    ([SEARCH], {"type": "function", "function": {"name": "search_docs"}}, {"tool": {"name": "search_docs"}}),
])
def test_a_json_schema_answer_is_asked_for_as_a_tool_the_model_must_call(
        tools: list[Any], choice: Any, converse_choice: dict[str, Any]) -> None:
    body = {"model": "r", "messages": [{"role": "user", "content": "plan it"}], "response_format": AS_PLAN,
            **({"tools": tools} if tools else {}), **({"tool_choice": choice} if choice else {})}
    req = BEDROCK.request(body, target(credential=""))
    config = json.loads(req.body)["toolConfig"]
    assert [t["toolSpec"]["name"] for t in config["tools"]] == [*(t["function"]["name"] for t in tools), OUTPUT_TOOL]
    assert config["tools"][-1]["toolSpec"]["inputSchema"] == {"json": PLAN}
    assert config["toolChoice"] == converse_choice
    assert ("response_format", Support.TRANSFORMED) in {(x.field, x.support) for x in req.losses}


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "array"}}}])
def test_a_format_converse_cannot_ask_for_is_reported_and_never_sent(response_format: dict[str, Any]) -> None:
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    req = BEDROCK.request(body, target(credential=""))
    assert ("response_format", Support.UNSUPPORTED) in {(x.field, x.support) for x in req.losses}
    assert "toolConfig" not in json.loads(req.body)


def test_a_tool_conversation_becomes_converse_blocks() -> None:
    native = native_body({"model": "r", "max_tokens": 50, "temperature": 1.4, "top_k": 5, "stop": "END", "user": "u7",
                          "tools": [SEARCH], "tool_choice": {"type": "function", "function": {"name": "search_docs"}},
                          "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "find it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search_docs", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"}, {"role": "user", "content": "thanks"}]})
    assert native["system"] == [{"text": "Be brief."}]
    assert native["messages"] == [
        {"role": "user", "content": [{"text": "find it"}]},
        {"role": "assistant", "content": [{"toolUse": {"toolUseId": "c1", "name": "search_docs",
                                                       "input": {"query": "x"}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": "c1", "content": [{"text": "found"}]}},
                                     {"text": "thanks"}]}]
    assert native["inferenceConfig"] == {"maxTokens": 50, "temperature": 1, "stopSequences": ["END"]}
    assert native["additionalModelRequestFields"] == {"top_k": 5}
    assert native["requestMetadata"] == {"user": "u7"}
    schema = {"json": SEARCH["function"]["parameters"]}
    assert native["toolConfig"] == {"tools": [{"toolSpec": {"name": "search_docs", "description": "docs",
                                                            "inputSchema": schema}}],
                                    "toolChoice": {"tool": {"name": "search_docs"}}}


def test_an_answer_becomes_a_chat_completion_with_normalised_usage() -> None:
    doc = {"output": {"message": {"role": "assistant", "content": [
        {"reasoningContent": {"reasoningText": {"text": "thinking..."}}}, {"text": "Let me look."},
        {"toolUse": {"toolUseId": "tooluse_1", "name": "lookup", "input": {"id": 7}}}]}},
        "stopReason": "tool_use", "metrics": {"latencyMs": 80},
        "usage": {"inputTokens": 40, "outputTokens": 9, "totalTokens": 109, "cacheReadInputTokens": 60,
                  "cacheWriteInputTokens": 0}}
    out = BEDROCK.response(200, json.dumps(doc).encode())
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert choice["message"]["reasoning"] == "thinking..."
    assert choice["message"]["tool_calls"] == [{"id": "tooluse_1", "type": "function",
                                                "function": {"name": "lookup", "arguments": '{"id": 7}'}}]
    # inputTokens leaves out what the cache served: the internal prompt count holds it.
    assert out["usage"] == {"prompt_tokens": 100, "completion_tokens": 9, "total_tokens": 109,
                            "prompt_tokens_details": {"cached_tokens": 60}}
    filtered = dict(doc, stopReason="guardrail_intervened")
    assert BEDROCK.response(200, json.dumps(filtered).encode())["choices"][0]["finish_reason"] == "content_filter"
    no_usage = {k: v for k, v in doc.items() if k != "usage"}
    for broken in (b"not json", b"[]", b'{"x": 1}', json.dumps(no_usage).encode(),
                   b'{"output": {"message": {"content": [{"toolUse": 1}]}}, "usage": {}}'):
        with pytest.raises(UpstreamBroken):
            BEDROCK.response(200, broken)


USAGE = {"inputTokens": 15, "outputTokens": 8, "totalTokens": 28, "cacheReadInputTokens": 5}


def stream_of(tool: bool = True, metadata: dict[str, Any] | None = None) -> bytes:
    events = [eventstream.event("messageStart", {"role": "assistant", "p": "ab"}),
              eventstream.event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "Chec"}}),
              eventstream.event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "king é"}}),
              eventstream.event("contentBlockStop", {"contentBlockIndex": 0})]
    if tool:
        events += [eventstream.event("contentBlockStart", {"contentBlockIndex": 1, "start": {
                       "toolUse": {"toolUseId": "tooluse_9", "name": "lookup"}}}),
                   eventstream.event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {
                       "input": '{"id"'}}}),
                   eventstream.event("contentBlockDelta", {"contentBlockIndex": 1, "delta": {"toolUse": {
                       "input": ': 7}'}}}),
                   eventstream.event("contentBlockStop", {"contentBlockIndex": 1})]
    events += [eventstream.event("messageStop", {"stopReason": "tool_use" if tool else "end_turn"}),
               eventstream.event("metadata", {"usage": USAGE, "metrics": {"latencyMs": 9}} if metadata is None
                                 else metadata)]
    return b"".join(events)


STREAM = stream_of()


@pytest.mark.parametrize("step", [1, 3, 17, 200, len(STREAM)])
def test_an_event_stream_split_anywhere_translates_to_the_same_chunks(step: int) -> None:
    t = BEDROCK.stream()
    out: list[bytes] = []
    for i in range(0, len(STREAM), step):
        out += t.feed(STREAM[i:i + step])
    out += t.finish()
    chunks = chunks_of(out)
    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    body = [c for c in chunks[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == "Checking é"
    calls = [tc for c in body for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": "tooluse_9", "type": "function",
                        "function": {"name": "lookup", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"id": 7}'  # split across chunks, joined
    assert body[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-2]["usage"] == {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28,
                                   "prompt_tokens_details": {"cached_tokens": 5}}


def test_a_broken_event_stream_is_reported_not_finished() -> None:
    throttled = eventstream.event("messageStart", {"role": "assistant"}) + eventstream.exception(
        "throttlingException", "Too many tokens")
    with pytest.raises(UpstreamBroken, match="throttlingException") as e:
        BEDROCK.stream().feed(throttled)
    assert len(e.value.partial) == 1  # the role chunk before it still reaches the client
    bad_crc = STREAM[:-1] + bytes([STREAM[-1] ^ 1])
    t = BEDROCK.stream()
    with pytest.raises(UpstreamBroken, match="framing"):
        t.feed(bad_crc)
    truncated = BEDROCK.stream()
    truncated.feed(STREAM[:-30])
    with pytest.raises(UpstreamBroken, match="before its metadata"):
        truncated.finish()
    after = BEDROCK.stream()
    with pytest.raises(UpstreamBroken, match="after the metadata"):
        after.feed(STREAM + STREAM)
    no_usage = BEDROCK.stream()
    with pytest.raises(UpstreamBroken, match="malformed metadata"):
        no_usage.feed(stream_of(False, metadata={"metrics": {"latencyMs": 1}}))
    huge = BEDROCK.stream()
    prelude = struct.pack(">II", 20 << 20, 0)  # a well-formed message of 20 MiB: botocore would wait for it
    huge.feed(prelude + struct.pack(">I", zlib.crc32(prelude)))
    with pytest.raises(UpstreamBroken, match="larger than"):
        for _ in range(5000):
            huge.feed(bytes(256))


event_docs = st.tuples(
    st.sampled_from(["messageStart", "contentBlockStart", "contentBlockDelta", "contentBlockStop", "messageStop",
                     "metadata", "other"]),
    st.fixed_dictionaries({}, optional={
        "contentBlockIndex": st.integers(0, 2) | st.text(max_size=2),
        "start": st.fixed_dictionaries({}, optional={"toolUse": st.fixed_dictionaries({}, optional={
            "toolUseId": st.text(max_size=3), "name": st.text(max_size=3) | st.integers()})}),
        "delta": st.fixed_dictionaries({}, optional={"text": st.text(max_size=4) | st.integers(),
                                                     "toolUse": st.fixed_dictionaries({}, optional={
                                                         "input": st.text(max_size=4)})}),
        "stopReason": st.sampled_from(["end_turn", "tool_use", 3]),
        "usage": st.dictionaries(st.sampled_from(["inputTokens", "outputTokens", "cacheReadInputTokens"]),
                                 st.integers(0, 9) | st.text(max_size=2))}))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64) | event_docs.map(lambda e: eventstream.event(*e))
                | st.just(eventstream.exception("modelStreamErrorException", "x")), max_size=10))
def test_nothing_but_upstream_broken_escapes_the_stream_translator(pieces: list[bytes]) -> None:
    feed_hostile(BEDROCK.stream(), pieces)


@pytest.mark.parametrize(("status", "body", "code", "retry"), [
    (429, b'{"message":"Too many requests, please wait before trying again."}', ErrorCode.UPSTREAM_ERROR,
     "rate_limited"),
    (503, b'{"message":"Service unavailable"}', ErrorCode.UPSTREAM_ERROR, "unavailable"),
    (500, b'{"message":"Internal"}', ErrorCode.UPSTREAM_ERROR, "unavailable"),
    (400, b'{"message":"Input is too long for requested model."}', ErrorCode.CONTEXT_LENGTH_EXCEEDED, ""),
    (403, b'{"message":"The request signature we calculated does not match"}', ErrorCode.UPSTREAM_ERROR, ""),
])
def test_provider_errors_map_to_the_contract(status: int, body: bytes, code: ErrorCode, retry: str) -> None:
    f = BEDROCK.failure(status, body)
    assert (f.code, f.retry) == (code, retry)


def test_the_path_names_the_model_and_the_operation() -> None:
    assert adapter_for("bedrock@1") is BEDROCK.adapter
    path, headers = BEDROCK.endpoint(target())
    assert path == "/model/anthropic.claude-sim-v1%3A0/converse"
    assert headers[":authority"] == "bedrock-runtime.eu-central-1.amazonaws.com"
    assert BEDROCK.endpoint(target(stream=True))[0].endswith("/converse-stream")
    private = Target(MODEL, KEY, {"region": "x", "host": "vpce.example"})  # a VPC endpoint, say
    assert BEDROCK.endpoint(private)[1][":authority"] == "vpce.example"
    assert check_options("bedrock@1", {}) and check_options("bedrock@1", {"region": "r", "kind": "x"})
    assert check_options("bedrock@1", {"region": "r", "host": "h"}) == ""


def _as_received(req: Any, authority: str) -> CIMultiDict[str]:
    """The headers a provider sees: what the gateway set, and what Envoy adds (never signed)."""
    return CIMultiDict({**{k: v for k, v in req.headers.items() if not k.startswith(":")}, "host": authority,
                        **req.signed_headers, "x-request-id": "r1", "x-envoy-expected-rq-timeout-ms": "30000"})


def test_the_signature_verifies_and_covers_path_body_and_time() -> None:
    req = BEDROCK.request({"model": "r", "messages": [{"role": "user", "content": "hi"}]}, target())
    authority = req.headers[":authority"]
    assert "x-amz-date" in req.signed_headers and req.signed_headers["authorization"].startswith(
        f"AWS4-HMAC-SHA256 Credential={KEY_ID}/")
    assert SECRET not in json.dumps(dict(req.signed_headers))
    headers = _as_received(req, authority)
    verify("POST", req.path, "", headers, req.body, KEY_ID, SECRET, "bedrock")
    for path, body, key, hdrs, kind in (
            (req.path, req.body + b" ", SECRET, headers, "InvalidSignatureException"),  # the body changed
            (req.path.replace("converse", "converse-stream"), req.body, SECRET, headers, "InvalidSignatureException"),
            (req.path, req.body, "another-secret", headers, "InvalidSignatureException"),
            (req.path, req.body, SECRET, CIMultiDict({**headers, "host": "elsewhere"}), "InvalidSignatureException"),
            (req.path, req.body, SECRET, CIMultiDict({**headers, "authorization": ""}),
             "MissingAuthenticationTokenException")):
        with pytest.raises(SignatureError) as e:
            verify("POST", path, "", hdrs, body, KEY_ID, SECRET if key == SECRET else key, "bedrock")
        assert e.value.kind == kind
    with pytest.raises(SignatureError, match="expired"):
        verify("POST", req.path, "", headers, req.body, KEY_ID, SECRET, "bedrock",
               now=datetime.now(UTC) + timedelta(minutes=6))
    session = BEDROCK.request({"model": "r", "messages": [{"role": "user", "content": "hi"}]},
                              target(credential=f"{KEY}:session-token-1"))
    assert session.signed_headers["x-amz-security-token"] == "session-token-1"
    assert "x-amz-security-token" in session.signed_headers["authorization"]  # signed too


# -- the simulated provider and the gateway in front of it -----------------------------------------

provider = module_provider("bedrock", MODEL, KEY, "--max-model-len", "8192")


def converse(provider: str, body: dict[str, Any], stream: bool = False, signed: bool = True,
             model: str = MODEL) -> Any:
    """A Converse call to the simulated provider, signed as the gateway signs it."""
    internal = internal_body(body, model, stream)
    req = BEDROCK.request(internal, Target(model, KEY if signed else "", OPTIONS, stream))
    host = provider.removeprefix("http://")
    headers = {"content-type": "application/json", **req.signed_headers}
    if signed:
        headers["host"] = req.headers[":authority"]
    return request(f"http://{host}{req.path}", "POST", req.body, headers)


def frames(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    buf = EventStreamBuffer()
    buf.add_data(body)
    return [(m.headers.get(":event-type") or m.headers[":exception-type"], json.loads(m.payload)) for m in buf]


@pytest.mark.e2e
def test_the_simulated_api_checks_what_bedrock_checks(provider: str) -> None:
    ask = {"messages": [{"role": "user", "content": [{"text": "hi"}]}], "inferenceConfig": {"maxTokens": 4}}
    r = converse(provider, ask)
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["stopReason"] == "max_tokens" and doc["usage"]["outputTokens"] == 4
    assert "cacheReadInputTokens" not in doc["usage"]  # no cachePoint asked for: none reported
    unsigned = converse(provider, ask, signed=False)
    assert unsigned.status == 403 and unsigned.headers["x-amzn-errortype"].startswith("MissingAuthentication")
    assert converse(provider, ask, model="other.model").status == 400
    starts_with_assistant = {"messages": [{"role": "assistant", "content": [{"text": "x"}]}]}
    assert "must start with a user" in converse(provider, starts_with_assistant).json()["message"]
    s = converse(provider, ask, stream=True)
    assert s.headers["content-type"] == "application/vnd.amazon.eventstream"
    kinds = [k for k, _ in frames(s.body)]  # botocore's parser reads the simulator's framing
    assert kinds == ["messageStart", *["contentBlockDelta"] * 4, "contentBlockStop", "messageStop", "metadata"]
    assert frames(s.body)[-1][1]["usage"]["outputTokens"] == 4


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, provider: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("bedrock-gw")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    ref = add_provider_route(policy, "bedrock-sim", "bedrock@1", "bedrock-converse@2023-09-30", MODEL,
                             provider.removeprefix("http://"), KEY, "chat-bedrock", options=OPTIONS)
    add_route_of(policy, "chat-bedrock-report", ref, "report", adapter="bedrock@1")
    s = start_stack(tmp / "state", policy)
    yield s
    s.stop()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)


def sent_to(provider: str, marker: str) -> list[dict[str, Any]]:
    return [e for e in request(f"{provider}/admin/requests").json() if marker in json.dumps(e["messages"])]


@pytest.mark.e2e
def test_the_openai_sdk_is_answered_by_the_bedrock_provider(gw: Stack, provider: str) -> None:
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="chat-bedrock", max_tokens=6, messages=[{"role": "system", "content": "brief"},
                                                      {"role": "user", "content": "hello bedrock"}])
    r = raw.parse()
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    assert r.usage and r.usage.completion_tokens == 6
    assert r.model == "chat-bedrock"  # the route asked for (Converse names no model)
    assert raw.headers["x-llmgw-deployment"] == "bedrock-sim"
    (sent,) = sent_to(provider, "hello bedrock")
    assert sent["status"] == 200  # the simulator verified the gateway's signature
    assert sent["path"] == "/model/anthropic.claude-sim-v1%3A0/converse"
    assert sent["headers"]["host"] == "bedrock-runtime.eu-central-1.amazonaws.com"
    assert sent["api_key_present"]
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    expected = (r.usage.prompt_tokens * PROVIDER_PRICES["input_per_mtok"]
                + 6 * PROVIDER_PRICES["output_per_mtok"]) // 1_000_000
    assert abs(entry["charged_micros"] - expected) <= 1, entry  # the provider's prices
    assert SECRET not in json.dumps(entry)


class Plan(BaseModel):
    day: str
    owner: str


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_sdk_gets_a_json_schema_answer_from_the_bedrock_provider(gw: Stack, provider: str,
                                                                          stream: bool) -> None:
    """response_format reaches Converse as a tool the model must call; the answer is its input, as content."""
    ask = [{"role": "user", "content": f"plan the launch (stream {stream})"}]
    if stream:
        with sdk(gw).chat.completions.stream(model="chat-bedrock", max_tokens=200, response_format=Plan,
                                             messages=ask) as s:  # type: ignore[arg-type]
            done = s.get_final_completion()
    else:
        done = sdk(gw).chat.completions.parse(model="chat-bedrock", max_tokens=200, response_format=Plan,
                                              messages=ask)  # type: ignore[arg-type]
    choice = done.choices[0]
    assert isinstance(choice.message.parsed, Plan) and choice.message.parsed.day, choice.message
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    (sent,) = sent_to(provider, f"plan the launch (stream {stream})")
    assert sent["status"] == 200


@pytest.mark.e2e
def test_a_stream_and_a_tool_call_split_across_chunks_from_the_bedrock_provider(gw: Stack) -> None:
    with sdk(gw).chat.completions.with_streaming_response.create(
            model="chat-bedrock", max_tokens=8, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "stream from bedrock"}]) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
    assert chunks[-1].usage and chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert {c.model for c in chunks} == {"chat-bedrock"}
    stream = sdk(gw).chat.completions.create(model="chat-bedrock", max_tokens=200, tools=[SEARCH],  # type: ignore[list-item]
                                             stream=True, messages=[{"role": "user",
                                                                     "content": "use search_docs for bedrock"}])
    pieces = [tc for c in stream if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert len(pieces) > 2 and pieces[0].function and pieces[0].function.name == "search_docs"
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert isinstance(json.loads(arguments)["query"], str)


@pytest.mark.e2e
def test_a_throttled_stream_is_interrupted_and_a_throttled_request_is_an_upstream_error(gw: Stack,
                                                                                         provider: str) -> None:
    request(f"{provider}/admin/faults", "POST", {"fault": "error_after=2", "count": 1, "match": "throttle me"})
    r = request(f"{gw.url}/v1/chat/completions", "POST", {
        "model": "chat-bedrock", "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": "throttle me"}]},
        {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert r.status == 200 and r.body.count(b'"content":"') >= 2  # what came before the exception was sent
    assert b"stream_interrupted" in r.body and b"[DONE]" not in r.body
    request(f"{provider}/admin/faults", "POST", {"fault": "status=429", "count": 1, "match": "throttled json"})
    with pytest.raises(openai.APIStatusError) as e:
        sdk(gw).chat.completions.create(model="chat-bedrock", max_tokens=4,
                                        messages=[{"role": "user", "content": "throttled json"}])
    assert e.value.status_code == 502 and e.value.code == "upstream_error"  # type: ignore[attr-defined]


@pytest.mark.e2e
def test_a_bedrock_stream_is_translated_in_envoy_and_metered(gw: Stack, provider: str) -> None:
    """A lone Bedrock candidate's AWS event stream is read by Envoy's Lua filter (extproc/direct.py,
    extproc/lua/eventstream.lua), with no attempt-filter stream: whole, it ends with [DONE] and is
    metered at the provider's usage; a message whose CRC does not match, or an end before the metadata
    event, reaches the client as `stream_interrupted`."""
    before = attempts_through_the_filter(gw, "bedrock-sim")

    def stream(content: str) -> tuple[str, bytes]:
        r = request(f"{gw.url}/v1/chat/completions", "POST", {
            "model": "chat-bedrock", "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": content}]},
            {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream", r.body[:200]
        return r.headers["x-request-id"], r.body

    rid, body = stream("a raw bedrock stream")
    assert body.rstrip().endswith(b"data: [DONE]") and b'"usage"' not in body
    entry = ledger_of(gw, rid, "acme")
    assert (entry["termination"], entry["settlement"], entry["usage"]["completion_tokens"]) == ("complete", "actual", 5)
    for fault in ("malformed_after=2", "end_after=2"):
        request(f"{provider}/admin/faults", "POST", {"fault": fault, "count": 1, "match": f"broken {fault}"})
        rid, body = stream(f"broken {fault}")
        events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
        assert json.loads(events[-1][6:])["error"]["code"] == "stream_interrupted" and b"[DONE]" not in body, fault
        assert ledger_of(gw, rid, "acme")["termination"] == "stream_interrupted", fault
    time.sleep(1)  # long enough for the metric to show an attempt, had there been one
    assert attempts_through_the_filter(gw, "bedrock-sim") == before


# (Hints are dropped and reported on every route: tested by test_sdk_matrix_e2e.py.)
UNSUPPORTED = [f for f, rule in LOSS_TABLE.items() if rule is Support.UNSUPPORTED and f not in HINT_FIELDS]
VALUES = {"seed": 7, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"1": 1}, "logprobs": True,
          "top_logprobs": 2, "response_format": {"type": "json_object"}, "parallel_tool_calls": False, "min_p": 0.1,
          "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True, "skip_special_tokens": False,
          "spaces_between_special_tokens": False, "include_stop_str_in_output": True, "reasoning_effort": "low",
          "verbosity": "low"}


@pytest.mark.e2e
@pytest.mark.parametrize("field", UNSUPPORTED)
def test_what_bedrock_cannot_carry_is_refused_before_it_is_sent(gw: Stack, provider: str, field: str) -> None:
    """Every contract Converse cannot carry, on a `reject` route: refused naming it, never sent."""
    marker = f"never sent {field.replace('_', ' ')}"
    body: dict[str, Any] = {"model": "chat-bedrock", "max_tokens": 4, field: VALUES[field],
                            "messages": [{"role": "user", "content": marker}]}
    if field == "parallel_tool_calls":
        body["tools"] = [SEARCH]
    r = request(f"{gw.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert r.status == 400 and r.json()["error"]["code"] == "unsupported_field", r.body
    assert r.json()["error"]["param"] == field
    assert not sent_to(provider, marker)


@pytest.mark.e2e
def test_what_bedrock_cannot_carry_is_served_and_reported_under_report(gw: Stack, provider: str) -> None:
    raw = sdk(gw).chat.completions.with_raw_response.create(
        model="chat-bedrock-report", max_tokens=4, seed=7, logprobs=True,
        messages=[{"role": "user", "content": "report what is lost"}])
    lost = {"max_tokens (transformed)", "seed (unsupported)", "logprobs (unsupported)"}
    assert set(raw.headers["x-llmgw-translation-loss"].split(", ")) == lost
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    (attempt,) = entry["attempts"]
    assert set(attempt["translation_loss"]) == lost
    (sent,) = sent_to(provider, "report what is lost")
    assert "seed" not in json.dumps(sent) and "logprobs" not in json.dumps(sent)


# -- over TLS, as a real provider is reached --------------------------------------------------------

HOST = "bedrock-runtime.eu-central-1.amazonaws.com"


@pytest.fixture(scope="module")
def tls_provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The simulated Bedrock provider serving HTTPS with a certificate for Bedrock's host name (from a
    CA of the test's own): (its address, the CA file)."""
    d = tmp_path_factory.mktemp("bedrock-tls")
    ca, cert, key = server_cert(d / "certs", HOST)
    port = free_port()
    child = Child("bedrock-tls", python_module("enginesim", "--port", str(port), "--api", "bedrock",
                                               "--served-model-name", MODEL, "--time-scale", "0.02",
                                               "--tls-cert", str(cert), "--tls-key", str(key)),
                  d / "log", env={"ENGINESIM_API_KEY": KEY}).start()
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.check_hostname = False  # the health check dials 127.0.0.1; Envoy checks the name below

    def healthy() -> bool:
        try:
            return urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx, timeout=2).status == 200
        except OSError:
            return False
    wait_until(healthy, 30, "enginesim over TLS", child)
    yield f"127.0.0.1:{port}", ca
    child.stop()


def _tls_policy(tmp: Path, address: str, ca: Path) -> Path:
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    shutil.copy(ca, policy / "provider-ca.crt")
    add_provider_route(policy, "bedrock-tls", "bedrock@1", "bedrock-converse@2023-09-30", MODEL, address, KEY,
                       "chat-bedrock-tls", options=OPTIONS)
    path = policy / "deployments/bedrock-tls.yaml"
    dep = yaml.safe_load(path.read_text())
    dep["tls"] = {"server_name": HOST, "ca_file": "provider-ca.crt"}  # relative to the policy directory
    path.write_text(yaml.safe_dump(dep))
    return policy


@pytest.mark.e2e
def test_a_provider_is_reached_over_tls_and_its_certificate_is_checked(
        tmp_path: Path, tls_provider: tuple[str, Path]) -> None:
    address, ca = tls_provider
    policy = _tls_policy(tmp_path, address, ca)
    s = start_stack(tmp_path / "state", policy)
    try:
        r = sdk(s).chat.completions.create(model="chat-bedrock-tls", max_tokens=4,
                                           messages=[{"role": "user", "content": "over tls"}])
        assert r.choices[0].message.content and r.usage and r.usage.completion_tokens == 4
    finally:
        s.stop()
    # Another CA: Envoy refuses the provider's certificate, and nothing is answered in its name.
    other = demo_certs(tmp_path / "other-ca")
    assert other.extproc is not None
    (policy / "provider-ca.crt").write_bytes(Path(other.extproc.ca_file).read_bytes())
    s = start_stack(tmp_path / "state2", policy)
    try:
        r2 = request(f"{s.url}/v1/chat/completions", "POST", {
            "model": "chat-bedrock-tls", "max_tokens": 4, "messages": [{"role": "user", "content": "wrong ca"}]},
            {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
        assert r2.status in (502, 503), r2.body
        assert r2.json()["error"]["code"] in ("upstream_error", "no_qualified_route"), r2.body
    finally:
        s.stop()
    assert yaml.safe_load((policy / "deployments/bedrock-tls.yaml").read_text())["tls"]["server_name"] == HOST
