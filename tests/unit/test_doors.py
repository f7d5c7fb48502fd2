"""The front doors' translations on their own (extproc/shapes/*/door.py): the request into the internal
contract, answers, errors and streams back into Anthropic's and Gemini's shapes. The same requests
through Envoy with the real SDKs: tests/e2e/doors/test_anthropic_door_e2e.py,
tests/e2e/doors/test_gemini_door_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.anthropic.door import DOOR as ANTHROPIC_DOOR
from extproc.shapes.anthropic.door import error, request
from extproc.shapes.gemini.door import DOOR as GEMINI_DOOR
from extproc.shapes.gemini.door import error as gemini_error
from extproc.shapes.gemini.door import request as gemini_request
from extproc.shapes.loss import NATIVE
from extproc.shapes.registry import door_for, models_door
from tests.oracles.anthropic_door import MessagesStream, answer
from tests.oracles.gemini_door import GenerateContentStream
from tests.oracles.gemini_door import answer as gemini_answer


def native(**kw: Any) -> bytes:
    return json.dumps({"model": "chat-default", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_the_door_is_chosen_by_path() -> None:
    assert door_for("/v1/messages") is not None and door_for("/v1/messages?beta=true") is not None
    assert door_for("/v1/chat/completions") is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="/[]:?#@%.abv1mesg", max_size=24))
def test_any_path_a_client_sends_is_read_as_the_path_it_is(path: str) -> None:
    """Every path reaches ext_proc now (an unknown one is answered there): none may raise (the fuzz
    found `//[` raising in urllib's urlsplit), and a path that starts with `//` is no host."""
    door_for(path), models_door(path, {})
    assert door_for("//host/v1/messages") is None and door_for("//x/v1beta/models/m:generateContent") is None


def test_a_request_becomes_the_internal_contract() -> None:
    body = request(native(
        system=[{"type": "text", "text": "Be brief."}], stop_sequences=["END"], temperature=0.5, top_k=5,
        metadata={"user_id": "u-1"}, stream=True,
        tools=[{"name": "search_docs", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "find it"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search_docs",
                                                     "input": {"q": "x"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                                               {"type": "text", "text": "thanks"}]}]))
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "search_docs", "arguments": '{"q": "x"}'}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "ok"}
    assert body["messages"][4] == {"role": "user", "content": "thanks"}
    assert body["stop"] == ["END"] and body["user"] == "u-1" and body["top_k"] == 5
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["stream_options"] == {"include_usage": True}  # Anthropic's events carry usage


@pytest.mark.parametrize("raw, code, param", [
    # Anthropic's own thinking switch is carried (to an Anthropic plan only), and checked as the API checks it.
    (native(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}), ErrorCode.INVALID_REQUEST,
     "thinking.budget_tokens"),
    (native(thinking={"type": "enabled"}), ErrorCode.INVALID_REQUEST, "thinking"),
    (native(thinking={"type": "enabled", "budget_tokens": 100}), ErrorCode.INVALID_REQUEST, "thinking"),
    (native(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]), ErrorCode.UNSUPPORTED_FIELD, "messages.1.content.0"),
    (native(mcp_servers=[]), ErrorCode.UNSUPPORTED_FIELD, "mcp_servers"),
    (native(service_tier="priority"), ErrorCode.INVALID_REQUEST, "service_tier"),  # its own field, checked
    (json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(), ErrorCode.INVALID_REQUEST,
     "max_tokens"),
    (native(max_tokens=0), ErrorCode.INVALID_REQUEST, "max_tokens"),
    (native(messages=[]), ErrorCode.INVALID_REQUEST, "messages"),
    (native(messages=[{"role": "tool", "content": "x"}]), ErrorCode.INVALID_REQUEST, "messages.0.role"),
    (native(output_config={"effort": "extreme"}), ErrorCode.INVALID_REQUEST, "output_config.effort"),
    (native(temperature=1.5), ErrorCode.INVALID_REQUEST, "temperature"),
    (native(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), ErrorCode.INVALID_REQUEST,
     "messages.0.content"),
    (b"{not json", ErrorCode.INVALID_REQUEST, None),
])
def test_bad_requests_are_refused_naming_the_field(raw: bytes, code: ErrorCode, param: str | None) -> None:
    with pytest.raises(GatewayError) as e:
        request(raw)
    assert e.value.code is code
    if param is not None:
        assert (e.value.param or "").startswith(param)


def test_claude_code_s_fields_become_the_contract_and_its_hints() -> None:
    """A system turn inside the conversation is a system message where it stands; the effort and the
    context management are Anthropic's own, and hints (to another shape: dropped and reported)."""
    edits = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1000}}]}
    body = request(native(output_config={"effort": "medium"}, context_management=edits, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "files changed"}]}, {"role": "user", "content": "c"}]))
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "system", "user"]
    assert body["messages"][2]["content"] == "files changed"
    assert body[NATIVE] == {"context_management": edits, "output_config.effort": "medium"}
    assert set(body[NATIVE]) <= ANTHROPIC_DOOR.hints and "response_format" not in body


def completion(message: dict[str, Any], finish: str, stop_reason: Any = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "model": "m", "choices": [
        {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                  "prompt_tokens_details": {"cached_tokens": 6}}}


def test_null_fields_ask_for_nothing_and_structured_output_is_carried() -> None:
    """What the anthropic SDK's model_dump() of its own answer carries (`"caller": null`) replays; a
    null optional field is no request; output_config.format becomes the internal json_schema."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = request(native(temperature=None, thinking=None, output_config={"format": {"type": "json_schema",
                                                                                      "schema": schema}},
                          messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                              {"type": "text", "text": "t", "citations": None},
                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": None}, "caller": None,
                               "toolset_name": None}]}]))
    assert "temperature" not in body and body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"q": null}'
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    with pytest.raises(GatewayError) as e:  # a value is still refused
        request(native(messages=[{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}, "caller": {"type": "direct"}}]}]))
    assert e.value.code is ErrorCode.UNSUPPORTED_FIELD and "caller" in (e.value.param or "")


def test_a_forced_tool_call_is_tool_use_and_ids_keep_their_prefix() -> None:
    """vLLM finishes a forced (named) tool call with "stop": the agent loop must still see tool_use. An
    upstream's own `msg_` id is not prefixed twice."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert answer(completion(call, "stop"))["stop_reason"] == "tool_use"
    assert answer(completion(call, "length"))["stop_reason"] == "max_tokens"
    doc = completion({"role": "assistant", "content": "x"}, "stop")
    assert answer({**doc, "id": "chatcmpl-msg_01abc"})["id"] == "msg_01abc"


def test_an_answer_becomes_a_message() -> None:
    m = answer(completion({"role": "assistant", "content": "hello"}, "stop", "END"))
    assert m["id"] == "msg_abc" and m["content"] == [{"type": "text", "text": "hello"}]
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "END")
    assert m["usage"] == {"input_tokens": 4, "cache_read_input_tokens": 6, "cache_creation_input_tokens": 0,
                          "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
                          "output_tokens": 4}
    m = answer(completion({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls"))
    assert m["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]
    assert m["stop_reason"] == "tool_use"
    assert answer(completion({"content": "x"}, "length"))["stop_reason"] == "max_tokens"


def test_errors_keep_status_and_code() -> None:
    body = json.loads(error(429, GatewayError(ErrorCode.BUDGET_EXHAUSTED, "no budget").body()))
    assert body == {"type": "error", "error": {"type": "rate_limit_error", "message": "no budget",
                                               "code": "budget_exhausted"}}
    kept = b'{"type": "error", "error": {"type": "api_error", "message": "x"}}'
    assert error(500, kept) == kept  # already Anthropic's
    assert json.loads(error(502, b"<html>"))["error"]["code"] == "upstream_error"


STREAM = b"".join(b"data: " + json.dumps(d).encode() + b"\n\n" for d in [
    {"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
    {"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"content": "lo"}}]},
    {"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
    {"id": "chatcmpl-s", "model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]},
    {"id": "chatcmpl-s", "model": "m", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                                "total_tokens": 8}},
]) + b"data: [DONE]\n\n"


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for e in raw.decode().split("\n\n"):
        if e:
            kind, data = e.split("\n", 1)
            out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_stream_becomes_anthropics_events() -> None:
    t = MessagesStream()
    got = events(t.feed(STREAM) + t.finish())
    assert [k for k, _ in got] == ["message_start", "content_block_start", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "content_block_start",
                                   "content_block_delta", "content_block_delta", "content_block_stop",
                                   "message_delta", "message_stop"]
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert "".join(d["delta"]["partial_json"] for k, d in got if d.get("delta", {}).get("type") == "input_json_delta") \
        == '{"a": 1}'
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use" and got[-2][1]["usage"]["output_tokens"] == 3


def fed_in_pieces(make: Callable[[], Any], stream: bytes, cuts: list[int]) -> bytes:
    """What a door's stream translator writes when `stream` arrives cut at `cuts`."""
    t, out, prev = make(), b"", 0
    for c in sorted(cuts):
        out += t.feed(stream[prev:c])
        prev = c
    return out + t.feed(stream[prev:]) + t.finish()


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_of_the_stream_gives_the_same_events(cuts: list[int]) -> None:
    assert fed_in_pieces(MessagesStream, STREAM, cuts) == fed_in_pieces(MessagesStream, STREAM, [])


def test_a_broken_stream_ends_with_an_error_event() -> None:
    interrupted = b'data: {"error": {"code": "stream_interrupted", "message": "cut"}}\n\n'
    for tail in (interrupted, b"data: {not json\n\n", b""):  # the contract's event, garbage, no [DONE]
        t = MessagesStream()
        got = events(t.feed(STREAM.split(b"data: [DONE]")[0][:200] + tail) + t.finish())
        assert got[-1][0] == "error" and got[-1][1]["error"]["code"] == "stream_interrupted"
        assert "message_stop" not in [k for k, _ in got]
        assert t.feed(b"data: [DONE]\n\n") == b""  # nothing after it


@settings(max_examples=300)
@given(st.binary(max_size=2000))
def test_random_bytes_never_raise(data: bytes) -> None:
    t = MessagesStream()
    out = t.feed(data) + t.finish()
    kinds = [k for k, _ in events(out)] if out else []
    assert kinds.count("message_stop") + kinds.count("error") <= 1  # one end at most


@settings(max_examples=200)
@given(st.lists(st.fixed_dictionaries({}, optional={
    "choices": st.lists(st.fixed_dictionaries({}, optional={
        "index": st.integers(0, 2), "finish_reason": st.sampled_from([None, "stop", "length", "tool_calls"]),
        "delta": st.fixed_dictionaries({}, optional={
            "content": st.one_of(st.none(), st.text(max_size=5)),
            "tool_calls": st.lists(st.fixed_dictionaries({"index": st.integers(0, 2)}, optional={
                "id": st.text(max_size=3), "function": st.fixed_dictionaries({}, optional={
                    "name": st.text(max_size=3), "arguments": st.text(max_size=5)})}), max_size=2)})}), max_size=2),
    "usage": st.fixed_dictionaries({"prompt_tokens": st.integers(0, 9), "completion_tokens": st.integers(0, 9)})}),
    max_size=8))
def test_valid_looking_chunks_give_well_formed_events(chunks: list[dict[str, Any]]) -> None:
    t = MessagesStream()
    raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    got = events(t.feed(raw) + t.finish())
    kinds = [k for k, _ in got]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")  # every block closed


# -- the Gemini door ---------------------------------------------------------------------------------

GPATH = "/v1beta/models/chat-default:generateContent"


def gnative(**kw: Any) -> bytes:
    return json.dumps({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], **kw}).encode()


def test_the_gemini_door_takes_the_route_from_the_path_and_both_spellings() -> None:
    assert door_for("/v1beta/models/chat-default:streamGenerateContent?alt=sse") is GEMINI_DOOR
    assert door_for("/v1beta/models/a/b:generateContent") is None
    body = gemini_request(gnative(system_instruction={"parts": [{"text": "brief"}]},
                                  generation_config={"max_output_tokens": 9, "stop_sequences": ["END"]},
                                  tools=[{"function_declarations": [{"name": "f", "parameters_json_schema": {}}]}],
                                  tool_config={"function_calling_config": {"mode": "ANY"}}), GPATH)
    assert body["model"] == "chat-default" and body["max_tokens"] == 9 and body["stop"] == ["END"]
    assert body["messages"][0] == {"role": "system", "content": "brief"} and body["tool_choice"] == "required"
    camel = gemini_request(gnative(systemInstruction={"parts": [{"text": "brief"}]},
                                   generationConfig={"maxOutputTokens": 9, "stopSequences": ["END"]},
                                   tools=[{"functionDeclarations": [{"name": "f", "parametersJsonSchema": {}}]}],
                                   toolConfig={"functionCallingConfig": {"mode": "ANY"}}), GPATH)
    assert camel == body
    streamed = gemini_request(gnative(), "/v1beta/models/r:streamGenerateContent?alt=sse")
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("raw, path, code, param", [
    (gnative(safetySettings=[{"category": "HARM_CATEGORY_X", "threshold": "LOUD"}]), GPATH,
     ErrorCode.INVALID_REQUEST, "safetySettings.0.threshold"),  # its own field, checked
    (gnative(cachedContent="c/1"), GPATH, ErrorCode.UNSUPPORTED_FIELD, "cachedContent"),
    (gnative(tools=[{"googleSearch": {}}]), GPATH, ErrorCode.UNSUPPORTED_FIELD, "tools.0.googleSearch"),
    (gnative(generationConfig={"responseLogprobs": True}), GPATH, ErrorCode.UNSUPPORTED_FIELD,
     "generationConfig.responseLogprobs"),
    (gnative(generationConfig={"topK": 5.5}), GPATH, ErrorCode.INVALID_REQUEST, "generationConfig.topK"),
    (gnative(generationConfig={"responseSchema": {"type": "OBJECT"}}), GPATH, ErrorCode.INVALID_REQUEST,
     "generationConfig"),  # a schema without responseMimeType application/json
    (gnative(tools=[{"functionDeclarations": [{"name": "f", "parameters": {"type": "OBJECT"},
                                               "parametersJsonSchema": {}}]}]), GPATH, ErrorCode.INVALID_REQUEST,
     "tools.0.functionDeclarations.0"),
    (gnative(tools=[{"functionDeclarations": [{"name": "f", "parameters": {"type": "OBJECT", "oneOf": []}}]}]),
     GPATH, ErrorCode.UNSUPPORTED_FIELD, "tools.0.functionDeclarations.0.parameters.oneOf"),
    (json.dumps({"contents": []}).encode(), GPATH, ErrorCode.INVALID_REQUEST, "contents"),
    (gnative(contents=[{"role": "tool", "parts": [{"text": "x"}]}]), GPATH, ErrorCode.INVALID_REQUEST,
     "contents.0.role"),
    (gnative(contents=[{"parts": [{"text": "x", "inlineData": {"mimeType": "a", "data": "b"}}]}]), GPATH,
     ErrorCode.INVALID_REQUEST, "contents.0.parts.0"),
    (gnative(), "/v1beta/models/r:streamGenerateContent", ErrorCode.INVALID_REQUEST, "alt"),
])
def test_the_gemini_door_refuses_what_it_cannot_carry(raw: bytes, path: str, code: ErrorCode, param: str) -> None:
    with pytest.raises(GatewayError) as e:
        gemini_request(raw, path)
    assert e.value.code is code and (e.value.param or "").startswith(param)


@pytest.mark.parametrize("version", ["v1", "v1beta", "v1alpha"])
def test_the_gemini_door_takes_every_api_version_the_sdk_asks(version: str) -> None:
    """google-genai addresses v1beta by default and v1 or v1alpha when its user says so."""
    path = f"/{version}/models/chat-default:streamGenerateContent?alt=sse"
    assert door_for(path) is GEMINI_DOOR and gemini_request(gnative(), path)["model"] == "chat-default"
    assert door_for("/v2/models/chat-default:generateContent") is None


def test_integer_fields_take_whole_numbers_as_proto3_json_does() -> None:
    body = gemini_request(gnative(generationConfig={"topK": 5.0, "candidateCount": 1.0, "maxOutputTokens": 9.0}),
                          GPATH)
    assert (body["top_k"], body["n"], body["max_tokens"]) == (5, 1, 9)
    assert all(type(body[k]) is int for k in ("top_k", "n", "max_tokens"))


def test_geminis_schema_becomes_json_schema() -> None:
    """What google-genai sends for a Python function (automatic function calling) and for
    types.Schema / a pydantic class as responseSchema: the OpenAPI subset, upper-case types, nullable."""
    params = {"type": "OBJECT", "required": ["city"], "properties": {
        "city": {"type": "STRING", "description": "where"},
        "days": {"type": "INTEGER", "default": 1, "minimum": 1, "maximum": 7},
        "units": {"type": "ARRAY", "nullable": True, "items": {"type": "STRING", "enum": ["c", "f"]}, "maxItems": "2"},
        "mode": {"anyOf": [{"type": "STRING"}, {"type": "NUMBER"}], "nullable": True}}}
    body = gemini_request(gnative(
        tools=[{"functionDeclarations": [{"name": "get_weather", "parameters": params,
                                          "response": {"type": "OBJECT"}}]}],
        generationConfig={"responseMimeType": "application/json", "responseSchema": {
            "type": "OBJECT", "title": "R", "property_ordering": ["a"], "properties": {"a": {"type": "INTEGER"}}}}),
        GPATH)
    assert body["tools"][0]["function"]["parameters"] == {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "where"},
            "days": {"type": "integer", "default": 1, "minimum": 1, "maximum": 7},
            "units": {"type": ["array", "null"], "maxItems": 2, "items": {"type": "string", "enum": ["c", "f"]}},
            "mode": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]}}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {
        "type": "object", "title": "R", "properties": {"a": {"type": "integer"}}}}}


def test_a_door_names_the_field_its_caller_wrote() -> None:
    assert GEMINI_DOOR.field_name("n") == "generationConfig.candidateCount"
    assert ANTHROPIC_DOOR.field_name("user") == "metadata.user_id"
    assert ANTHROPIC_DOOR.field_name("parallel_tool_calls") == "tool_choice.disable_parallel_tool_use"
    assert ANTHROPIC_DOOR.field_name("top_k") == "top_k"


def test_a_gemini_answer_and_error() -> None:
    doc = gemini_answer(completion({"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls"))
    (cand,) = doc["candidates"]
    assert cand["content"]["parts"] == [{"text": "hi"}, {"functionCall": {"name": "f", "args": {"a": 1}}}]
    assert cand["finishReason"] == "STOP" and doc["responseId"] == "abc"
    assert doc["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 4, "totalTokenCount": 14,
                                    "cachedContentTokenCount": 6}
    err = json.loads(gemini_error(429, GatewayError(ErrorCode.BUDGET_EXHAUSTED, "no budget").body()))["error"]
    assert (err["code"], err["status"], err["details"][0]["reason"]) == (429, "RESOURCE_EXHAUSTED", "budget_exhausted")


def gframes(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\r\n\r\n") if e]


def test_a_stream_becomes_geminis_responses() -> None:
    t = GenerateContentStream()
    frames = gframes(t.feed(STREAM) + t.finish())
    texts = [p["text"] for f in frames[:-1] for p in f["candidates"][0]["content"]["parts"]]
    assert texts == ["Hel", "lo"]
    last = frames[-1]
    assert last["candidates"][0]["finishReason"] == "STOP"  # a function call ends the turn: STOP
    assert last["candidates"][0]["content"]["parts"] == [{"functionCall": {"name": "f", "args": {"a": 1}}}]
    assert last["usageMetadata"]["candidatesTokenCount"] == 3


@given(st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_gives_the_same_gemini_stream(cuts: list[int]) -> None:
    assert fed_in_pieces(GenerateContentStream, STREAM, cuts) == fed_in_pieces(GenerateContentStream, STREAM, [])


@settings(max_examples=300)
@given(st.binary(max_size=2000))
def test_random_bytes_never_break_the_gemini_stream(data: bytes) -> None:
    t = GenerateContentStream()
    frames = gframes(t.feed(data) + t.finish())
    assert frames and ("error" in frames[-1] or "finishReason" in frames[-1]["candidates"][0])
    assert sum("error" in f for f in frames) <= 1


def test_a_model_lookup_is_answered_in_the_shape_of_the_sdk_that_asks() -> None:
    assert models_door("/v1beta/models/chat-default", {}) is GEMINI_DOOR
    assert models_door("/v1alpha/models", {}) is GEMINI_DOOR
    assert models_door("/v1/models/chat-default", {"x-goog-api-key": "k"}) is GEMINI_DOOR  # api_version v1
    assert models_door("/v1/models/chat-default", {"anthropic-version": "2023-06-01"}) is ANTHROPIC_DOOR
    assert models_door("/v1/models", {"authorization": "Bearer k"}) is None  # OpenAI's
    gemini = GEMINI_DOOR.model_object("r", 8192, 512)  # type: ignore[misc]
    assert gemini["name"] == "models/r" and (gemini["inputTokenLimit"], gemini["outputTokenLimit"]) == (8192, 512)
    listed = ANTHROPIC_DOOR.model_list([ANTHROPIC_DOOR.model_object("r", 8192, 512)])  # type: ignore[misc]
    assert listed["data"][0]["id"] == "r" and listed["has_more"] is False and listed["first_id"] == "r"


def test_a_token_count_is_the_doors_request_without_generation() -> None:
    """count_tokens and countTokens become the internal request whose prompt is counted (one token to
    generate: the contract's bound; nothing is generated)."""
    assert ANTHROPIC_DOOR.counts("/v1/messages/count_tokens") and not ANTHROPIC_DOOR.counts("/v1/messages")
    assert door_for("/v1beta/models/r:countTokens") is GEMINI_DOOR and GEMINI_DOOR.counts("/v1/models/r:countTokens")
    a = ANTHROPIC_DOOR.count_request(json.dumps({  # type: ignore[misc]
        "model": "chat-default", "system": "brief", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}).encode(), "/v1/messages/count_tokens")
    assert a["messages"][0] == {"role": "system", "content": "brief"} and a["max_tokens"] == 1 and a["tools"]
    contents = [{"role": "user", "parts": [{"text": "hi"}]}]
    g1 = GEMINI_DOOR.count_request(json.dumps({"contents": contents}).encode(),  # type: ignore[misc]
                                   "/v1beta/models/chat-default:countTokens")
    g2 = GEMINI_DOOR.count_request(json.dumps({"generateContentRequest": {  # type: ignore[misc]
        "model": "models/chat-default", "contents": contents}}).encode(), "/v1/models/chat-default:countTokens")
    assert g1 == g2 == {"model": "chat-default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for bad, count_path, door in [(b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}',
                                   "/v1/messages/count_tokens", ANTHROPIC_DOOR),
                                  (b'{}', "/v1beta/models/r:countTokens", GEMINI_DOOR)]:
        with pytest.raises(GatewayError):
            door.count_request(bad, count_path)  # type: ignore[misc]


def test_a_doors_own_fields_travel_apart_for_a_plan_of_its_shape() -> None:
    """Gemini's safetySettings and Anthropic's service_tier are checked by the door and carried beside
    the contract (NATIVE), which only an adapter of the door's shape sends on, as they came."""
    from extproc.shapes.base import Target
    from extproc.shapes.loss import NATIVE
    from extproc.shapes.registry import adapter_for

    safety = [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_ONLY_HIGH"}]
    g = gemini_request(gnative(safetySettings=safety), GPATH)
    assert g[NATIVE] == {"safetySettings": safety}
    sent = json.loads(adapter_for("gemini@1").request(g, Target("gem")).body)
    assert sent["safetySettings"] == safety and NATIVE not in sent
    a = request(native(service_tier="standard_only"))
    assert a[NATIVE] == {"service_tier": "standard_only"}
    sent = json.loads(adapter_for("anthropic@1").request(a, Target("claude")).body)
    assert sent["service_tier"] == "standard_only" and NATIVE not in sent
    with pytest.raises(GatewayError):  # still checked: an unknown category is the door's 400
        gemini_request(gnative(safetySettings=[{"category": "nope", "threshold": "OFF"}]), GPATH)


def test_a_replayed_thought_is_reasoning_not_text() -> None:
    """google-genai replays a model turn's parts as it got them; a `thought` part is the model's
    reasoning, which must not become the assistant's visible text in the next turn."""
    body = gemini_request(gnative(contents=[
        {"role": "user", "parts": [{"text": "q"}]},
        {"role": "model", "parts": [{"text": "let me think", "thought": True}, {"text": "the answer"}]},
        {"role": "user", "parts": [{"text": "and?"}]}]), GPATH)
    assert body["messages"][1] == {"role": "assistant", "content": "the answer", "reasoning": "let me think"}


# -- thinking: each provider's own switch, and reasoning carried both ways ------------------------------

def test_anthropic_thinking_is_its_own_field_and_a_replayed_block_keeps_its_signature() -> None:
    from extproc.shapes.anthropic.adapter import native_body
    from extproc.shapes.loss import NATIVE
    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "SIG"},
                                             {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
    body = request(native(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                          messages=[{"role": "user", "content": "x"}, turn,
                                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]))
    assert body[NATIVE] == {"thinking": {"type": "enabled", "budget_tokens": 1024}} and "thinking" not in body
    assert body["messages"][1]["reasoning"] == "hmm" and body["messages"][1]["reasoning_signature"] == "SIG"
    sent = native_body(body, "claude")
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert sent["messages"][1]["content"][0] == {"type": "thinking", "thinking": "hmm", "signature": "SIG"}
    # Unsigned reasoning (another provider's, or two blocks whose signatures cannot be joined) is not sent.
    unsigned = {**body, "messages": [body["messages"][0], {**body["messages"][1], "reasoning_signature": None}]}
    assert native_body(unsigned, "claude")["messages"][1]["content"][0]["type"] == "tool_use"
    two = request(native(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "a", "signature": "S1"}, {"type": "thinking", "thinking": "b",
                                                                    "signature": "S2"}]}]))
    assert two["messages"][1]["reasoning"] == "ab" and "reasoning_signature" not in two["messages"][1]


def test_a_signature_reaches_only_a_provider_that_takes_it() -> None:
    from extproc.shapes.base import Target
    from extproc.shapes.openai.adapter import OpenAIAdapter
    body = {"model": "m", "messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": "y", "reasoning": "r",
                                        "reasoning_signature": "SIG"}]}
    for kind, kept in (("vllm", True), ("openai", False), ("azure", False)):
        sent = json.loads(OpenAIAdapter().request(body, Target("m", options={"kind": kind})).body)
        assert ("reasoning_signature" in sent["messages"][1]) is kept, kind


def test_gemini_thinking_config_is_its_own_field_set_inside_generation_config() -> None:
    from extproc.shapes.gemini.adapter import native_body
    from extproc.shapes.loss import NATIVE
    body = gemini_request(gnative(generationConfig={"maxOutputTokens": 50, "thinkingConfig": {
        "includeThoughts": True, "thinkingBudget": 100}}), GPATH)
    assert body[NATIVE] == {"generationConfig.thinkingConfig": {"includeThoughts": True, "thinkingBudget": 100}}
    assert native_body(body)["generationConfig"] == {"maxOutputTokens": 50, "thinkingConfig": {
        "includeThoughts": True, "thinkingBudget": 100}}
    with pytest.raises(GatewayError) as e:
        gemini_request(gnative(generationConfig={"thinkingConfig": {"thinkingBudget": -2}}), GPATH)
    assert e.value.code is ErrorCode.INVALID_REQUEST and "thinkingBudget" in (e.value.param or "")


# -- prompt caching breakpoints ---------------------------------------------------------------------------

CC = {"type": "ephemeral"}


def test_a_caching_breakpoint_is_carried_where_the_provider_caches_only_when_asked() -> None:
    from extproc import chat
    from extproc.shapes.anthropic.adapter import native_body
    from extproc.shapes.bedrock.adapter import native_body as bedrock_body
    from extproc.shapes.loss import CACHE_CONTROL, Support, losses
    from extproc.shapes.openai.adapter import VLLM_TABLE
    body = chat.validate(request(native(
        system=[{"type": "text", "text": "rules", "cache_control": CC}],
        tools=[{"name": "search_docs", "input_schema": {"type": "object"}, "cache_control": CC}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b", "cache_control": CC}]}])), 100, 1)
    assert body["messages"][0]["content"] == [{"type": "text", "text": "rules", "cache_control": CC}]
    sent = native_body(body, "claude")
    assert sent["system"] == [{"type": "text", "text": "rules", "cache_control": CC}]
    assert sent["messages"][0]["content"][1] == {"type": "text", "text": "b", "cache_control": CC}
    assert sent["tools"][0]["cache_control"] == CC
    # Converse marks the same places with a cachePoint block after them.
    converse = bedrock_body(body)
    assert converse["system"][-1] == converse["messages"][0]["content"][-1] == {"cachePoint": {"type": "default"}}
    assert converse["toolConfig"]["tools"][-1] == {"cachePoint": {"type": "default"}}
    assert [x.support for x in losses(body, VLLM_TABLE) if x.field == CACHE_CONTROL] == [Support.EMULATED]
    # Unmarked, the system prompt stays one string, as before.
    assert native_body(chat.validate(request(native(system="rules")), 100, 1), "claude")["system"] == "rules"


@pytest.mark.parametrize("hint", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"}, "ephemeral"])
def test_a_malformed_breakpoint_is_refused_naming_it(hint: Any) -> None:
    from extproc import chat
    with pytest.raises(GatewayError) as e:
        chat.validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": hint}]}]}, 100, 1)
    assert e.value.code is ErrorCode.INVALID_REQUEST and "cache_control" in (e.value.param or "")


def test_the_contracts_own_shape_is_sent_without_breakpoints() -> None:
    from extproc.service.attempts import body_for
    from extproc.shapes.base import Target
    from extproc.shapes.openai.adapter import OpenAIAdapter
    marked = [{"type": "text", "text": "x", "cache_control": CC}]
    body = {"model": "m", "messages": [{"role": "user", "content": marked}],
            "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": CC}]}
    for kind in ("vllm", "openai", "azure"):
        assert b"cache_control" not in OpenAIAdapter().request(body, Target("m", options={"kind": kind})).body

    class Dep:
        served_model = "m"
    again = body_for(json.dumps(body).encode(), Dep())  # type: ignore[arg-type]
    assert again is not None and b"cache_control" not in again
