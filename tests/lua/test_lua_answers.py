"""The Lua answer filter (extproc/lua/answers.lua, as the renderer renders it, with extproc/lua/json.lua),
run under LuaJIT (lupa's build) with a stand-in for Envoy's stream handle. Its translation of each
shape's answer (Anthropic, Gemini, Bedrock) must be the Python adapter's (extproc/shapes/), which
the attempt filter uses: the two are compared on generated answers. Through real Envoy it is tested
by tests/e2e/doors/test_translated_route_e2e.py, tests/slow/test_provider_fuzz_e2e.py and the providers' e2e tests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim import eventstream
from extproc.names import Header, Key
from extproc.shapes.anthropic.adapter import STOP_REASONS
from extproc.shapes.bedrock import adapter as bedrock
from extproc.shapes.gemini import adapter as gemini
from llmgw.render.filters import answers_lua
from tests.lua_harness import lua_runtime, lua_table
from tests.oracles.anthropic import ANTHROPIC
from tests.oracles.base import Oracle as Adapter
from tests.oracles.base import UpstreamBroken
from tests.oracles.bedrock import BEDROCK
from tests.oracles.gemini import GEMINI

MODEL = "claude-sim-1"
REQUEST_ID = "5f0c2a9e-request"


@pytest.fixture(scope="module")
def lua() -> Any:
    return lua_runtime(answers_lua())


def answer(lua: Any, body: bytes | None, *, status: str = "200", shape: str = "anthropic",
           md: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> tuple[
        bytes | None, dict[str, str]]:
    """What the client gets: the body and the response headers."""
    meta = {Key.ANSWER_SHAPE: shape, Key.ANSWER_MODEL: MODEL, Key.REQUEST_ID: REQUEST_ID, **(md or {})}
    hdrs = {":status": status, "content-type": "application/json; charset=utf-8", **(headers or {})}
    out, got, _ = lua.globals().run_response(lua_table(lua, meta), lua_table(lua, hdrs), body)
    return out, {k.decode(): v.decode() for k, v in got.items()}


def python_answer(body: bytes, adapter: Adapter = ANTHROPIC) -> dict[str, Any]:
    """What the attempt filter makes of the same answer."""
    out = adapter.response(200, body)
    if not out.get("model"):
        out["model"] = MODEL
    return out


def comparable(doc: dict[str, Any], ids: bool = True) -> dict[str, Any]:
    """A completion without its creation time, each tool call's arguments parsed; without the ids
    (`ids` False) where the Python adapter makes random ones and the Lua filter names them after the
    request."""
    doc = {k: v for k, v in doc.items() if k != "created" and (ids or k != "id")}
    for call in doc["choices"][0]["message"].get("tool_calls") or ():
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if not ids:
            del call["id"]
    return doc


text = st.text(max_size=20)
scalars = (st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False)
           | text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=10)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": text}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text}, optional={
        "input": st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=4)}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": text}),
)
counts = st.none() | st.integers(0, 10**9)
usages = st.fixed_dictionaries({}, optional={k: counts for k in (
    "input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")})
messages = st.fixed_dictionaries({"type": st.just("message"), "role": st.just("assistant")}, optional={
    "id": text, "model": text, "content": st.none() | st.lists(blocks, max_size=5),
    "stop_reason": st.none() | st.sampled_from([*STOP_REASONS, "something_new"]),
    "stop_sequence": st.none() | text, "usage": st.none() | usages})


tool_inputs = st.none() | st.dictionaries(st.text(max_size=6), json_values, max_size=4)
gemini_parts = st.one_of(
    st.fixed_dictionaries({"text": text}),
    st.fixed_dictionaries({"text": text, "thought": st.just(True)}),
    st.fixed_dictionaries({"functionCall": st.fixed_dictionaries({"name": text}, optional={"args": tool_inputs})}),
)
gemini_answers = st.fixed_dictionaries({"candidates": st.lists(st.fixed_dictionaries({}, optional={
    "content": st.fixed_dictionaries({}, optional={"role": st.just("model"),
                                                   "parts": st.lists(gemini_parts, max_size=5)}),
    "finishReason": st.sampled_from([*gemini.FINISH_REASONS, "SOMETHING_NEW"])}), max_size=2)}, optional={
    "responseId": text, "modelVersion": text, "promptFeedback": st.fixed_dictionaries({}, optional={
        "blockReason": st.sampled_from(["SAFETY", "OTHER"])}),
    "usageMetadata": st.none() | st.fixed_dictionaries({}, optional={k: counts for k in (
        "promptTokenCount", "candidatesTokenCount", "cachedContentTokenCount", "thoughtsTokenCount")})})
bedrock_blocks = st.one_of(
    st.fixed_dictionaries({"text": text}),
    st.fixed_dictionaries({"toolUse": st.fixed_dictionaries({"toolUseId": text, "name": text},
                                                            optional={"input": tool_inputs})}),
    st.fixed_dictionaries({"reasoningContent": st.fixed_dictionaries({}, optional={
        "reasoningText": st.fixed_dictionaries({}, optional={"text": text, "signature": text})})}),
)
bedrock_answers = st.fixed_dictionaries({
    "output": st.fixed_dictionaries({"message": st.fixed_dictionaries({
        "role": st.just("assistant"), "content": st.lists(bedrock_blocks, max_size=5)})}),
    "usage": st.fixed_dictionaries({"inputTokens": st.integers(0, 10**9), "outputTokens": st.integers(0, 10**9)},
                                   optional={"cacheReadInputTokens": counts, "cacheWriteInputTokens": counts})},
    optional={"stopReason": st.sampled_from([*bedrock.STOP_REASONS, "something_new"])})
SHAPES = {"anthropic": (messages, ANTHROPIC), "gemini": (gemini_answers, GEMINI),
          "bedrock": (bedrock_answers, BEDROCK)}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_lua_translation_is_the_python_adapters(lua: Any, shape: str) -> None:
    answers, adapter = SHAPES[shape]

    @settings(max_examples=300, deadline=None)
    @given(answers, st.booleans(), st.sampled_from([None, 0, 2]))
    def translates_alike(doc: dict[str, Any], ascii_only: bool, indent: int | None) -> None:
        body = json.dumps(doc, ensure_ascii=ascii_only, indent=indent).encode()
        out, headers = answer(lua, body, shape=shape)
        assert out is not None and headers[":status"] == "200" and headers["content-type"] == "application/json"
        # Gemini names its calls after its response id, and Bedrock has none: Python makes random ids.
        ids = shape == "anthropic" or (shape == "gemini" and bool(doc.get("responseId")))
        assert comparable(json.loads(out), ids) == comparable(python_answer(body, adapter), ids)
        if not ids:
            lua_doc = json.loads(out)
            named = [c["id"] for c in lua_doc["choices"][0]["message"].get("tool_calls") or ()]
            if shape == "bedrock":
                assert lua_doc["id"] == f"chatcmpl-{REQUEST_ID}"
            else:
                assert named == [f"call_{REQUEST_ID}_{n}" for n in range(len(named))]

    translates_alike()


def test_tool_calls_keep_their_arguments_exactly_as_the_provider_wrote_them(lua: Any) -> None:
    body = (b'{"type":"message","id":"m1","model":"claude","content":[{"type":"text","text":"caf\\u00e9 \\"q\\""},'
            b'{"type":"tool_use","id":"t1","name":"lookup","input":{"q": "a\\nb", "n": [1, 2.5e3]}}],'
            b'"stop_reason":"tool_use","usage":{"input_tokens":3,"cache_read_input_tokens":4,'
            b'"cache_creation_input_tokens":5,"output_tokens":6}}')
    out, _ = answer(lua, body)
    doc = json.loads(out or b"")
    message = doc["choices"][0]["message"]
    assert message["content"] == 'caf\u00e9 "q"' and doc["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"]["arguments"] == '{"q": "a\\nb", "n": [1, 2.5e3]}'
    assert doc["usage"] == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18,
                            "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 5}}
    assert comparable(doc) == comparable(python_answer(body))


@pytest.mark.parametrize("with_call", [False, True])
def test_a_bedrock_answer_given_as_the_schema_asked_is_its_content(lua: Any, with_call: bool) -> None:
    """A response_format schema goes to Converse as a tool the model must call (extproc/shapes/bedrock):
    that call's input, as the provider wrote it, is the answer's content; its stop is the answer's end."""
    given = b'{"day": "friday", "owner": {"name": "ana", "n": [1, 2.5e3]}}'
    call = (b',{"toolUse":{"toolUseId":"t2","name":"search","input":{"q":"x"}}}' if with_call else b"")
    body = (b'{"output":{"message":{"role":"assistant","content":[{"toolUse":{"toolUseId":"t1","name":"'
            + bedrock.OUTPUT_TOOL.encode() + b'","input":' + given + b"}}" + call + b']}},"stopReason":"tool_use",'
            b'"usage":{"inputTokens":3,"outputTokens":6}}')
    out, _ = answer(lua, body, shape="bedrock")
    doc = json.loads(out or b"")
    choice = doc["choices"][0]
    assert choice["message"]["content"] == given.decode()
    called = [c["function"]["name"] for c in choice["message"].get("tool_calls") or ()]
    assert called == (["search"] if with_call else [])
    assert choice["finish_reason"] == ("tool_calls" if with_call else "stop")
    python = python_answer(body, BEDROCK)
    assert json.loads(python["choices"][0]["message"]["content"]) == json.loads(given)
    assert python["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_cache_writes_are_their_own_classes_by_ttl_and_bedrocks_writes_too(lua: Any) -> None:
    """Anthropic splits its writes by TTL (`cache_creation`); Bedrock has one write count. Each is its
    own field of the internal usage, among the prompt tokens, so each is priced at its own rate."""
    body = (b'{"type":"message","id":"m1","model":"claude","content":[{"type":"text","text":"ok"}],'
            b'"stop_reason":"end_turn","usage":{"input_tokens":3,"cache_read_input_tokens":4,'
            b'"cache_creation_input_tokens":50,"cache_creation":{"ephemeral_5m_input_tokens":20,'
            b'"ephemeral_1h_input_tokens":30},"output_tokens":6}}')
    doc = json.loads(answer(lua, body)[0] or b"")
    assert doc["usage"]["prompt_tokens"] == 57
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 4, "cache_write_tokens": 20,
                                                     "cache_write_1h_tokens": 30}
    assert comparable(doc) == comparable(python_answer(body))
    over = body.replace(b'"ephemeral_1h_input_tokens":30', b'"ephemeral_1h_input_tokens":51')
    assert answer(lua, over)[1].get(":status") == "502"  # more 1-hour writes than writes: no usage to believe
    bedrock_body = (b'{"output":{"message":{"role":"assistant","content":[{"text":"ok"}]}},"stopReason":"end_turn",'
                    b'"usage":{"inputTokens":3,"outputTokens":6,"cacheReadInputTokens":4,"cacheWriteInputTokens":9}}')
    doc = json.loads(answer(lua, bedrock_body, shape="bedrock")[0] or b"")
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 4, "cache_write_tokens": 9}


def test_a_streams_cumulative_message_delta_replaces_the_starts_input_counts(lua: Any) -> None:
    """The API now repeats the input counts in message_delta (cumulative): the usage chunk carries them."""
    start = {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "model": "c",
                                                  "content": [], "usage": {"input_tokens": 1, "output_tokens": 1}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {
        "input_tokens": 5, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 11,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 11}, "output_tokens": 3}}
    body, _ = lua_stream(lua, [b"".join(sse_event(e) for e in (start, delta, {"type": "message_stop"}))])
    (usage,) = [e["usage"] for e in events_of(body) if isinstance(e, dict) and e.get("usage")]
    assert usage["prompt_tokens"] == 23 and usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": 7, "cache_write_1h_tokens": 11}


def test_a_bedrock_answer_cut_inside_its_schema_is_the_text_written_so_far(lua: Any) -> None:
    """max_tokens cut the output tool's input: the JSON so far is the content, as an OpenAI model's
    cut document would be, and the finish is `length`."""
    body = (b'{"output":{"message":{"role":"assistant","content":[{"toolUse":{"toolUseId":"t1","name":"'
            + bedrock.OUTPUT_TOOL.encode() + b'","input":"{\\"day\\": \\"fri"}}]}},"stopReason":"max_tokens",'
            b'"usage":{"inputTokens":3,"outputTokens":6}}')
    out, _ = answer(lua, body, shape="bedrock")
    choice = json.loads(out or b"")["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ('{"day": "fri', "length")
    python = python_answer(body, BEDROCK)["choices"][0]
    assert (python["message"]["content"], python["finish_reason"]) == ('{"day": "fri', "length")


BROKEN = [b"", b"not json", b"[1,2]", b'{"type":"error","error":{"type":"api_error"}}',
          b'{"type":"message","content":{"type":"text"}}', b'{"type":"message","content":["text"]}',
          b'{"type":"message","content":[{"type":"tool_use","name":"f","input":{}}]}',
          b'{"type":"message","content":[{"type":"tool_use","id":"t","name":"f","input":[1]}]}',
          b'{"type":"message","content":[{"type":"text","text":"a"}]} trailing',
          b'{"type":"message","usage":{"input_tokens":"many"}}', b'{"type":"message","usage":[1]}',
          b'{"type":"message","content":[{"type":"text","text":"a"',
          b'{"type":"message","content":' + b"[" * 100 + b"]" * 100 + b"}"]  # deeper than the decoder goes


@pytest.mark.parametrize("body", BROKEN)
def test_an_answer_that_is_not_a_message_is_the_contracts_502(lua: Any, body: bytes) -> None:
    out, headers = answer(lua, body)
    assert headers[":status"] == "502" and headers["content-type"] == "application/json"
    assert json.loads(out or b"")["error"]["code"] == "upstream_error"
    meta = {Key.ANSWER_SHAPE: "anthropic", Key.ANSWER_MODEL: MODEL, Key.REQUEST_ID: REQUEST_ID}
    sets = lua.globals().run_response(lua_table(lua, meta), lua_table(lua, {":status": "200"}), body)[2]
    assert dict(sets.items()) == {Key.ANSWER_BROKEN.encode(): b"1"}  # settlement: the provider did the work
    with pytest.raises(UpstreamBroken):
        ANTHROPIC.response(200, body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet='{}[]":,0123456789.e-truefalsnl \\u', max_size=80).map(str.encode))
def test_any_bytes_are_a_completion_or_the_contracts_502_and_never_a_script_error(lua: Any, body: bytes) -> None:
    for shape in (*SHAPES, "openai"):
        out, headers = answer(lua, body, shape=shape)
        doc = json.loads(out or b"")
        refused = "error" in doc and doc.get("error", {}).get("code") == "upstream_error"
        assert (headers[":status"] == "502") == refused


def test_a_hosted_openai_answer_is_checked_and_passed_as_it_came(lua: Any) -> None:
    body = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"content":"hi"}}]}'
    assert answer(lua, body, shape="openai") == (body, {":status": "200", "content-type": "application/json"})
    out, headers = answer(lua, b'{"id":"x","choices":{}}', shape="openai")
    assert headers[":status"] == "502" and json.loads(out or b"")["error"]["code"] == "upstream_error"


def test_the_attempt_filters_headers_choose_the_shape_only_without_the_decisions(lua: Any) -> None:
    """A plan's candidate of another shape is named by the attempt filter's headers (issue 27); a lone
    candidate by the decision's metadata, which an upstream's own headers of those names never override.
    Either way they never reach the client."""
    openai_body = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"content":"hi"}}]}'
    named = {Header.ANSWER_SHAPE: "openai", Header.ANSWER_MODEL: "m"}
    hdrs = {":status": "200", "content-type": "application/json", **named}
    out, got, _ = lua.globals().run_response(lua_table(lua, {Key.REQUEST_ID: REQUEST_ID}), lua_table(lua, hdrs),
                                             openai_body)
    assert out == openai_body and got[b":status"] == b"200"  # read as the header said: checked, passed
    assert not {k.decode() for k in got} & set(named)
    # The decision translated for an Anthropic-shaped candidate: a header saying otherwise is ignored.
    out, headers = answer(lua, openai_body, headers=named)
    assert headers[":status"] == "502" and not set(headers) & set(named)  # read as Anthropic's: not one


def test_error_statuses_and_the_degraded_answer_pass_untouched_and_the_loss_is_named(lua: Any) -> None:
    loss = {Key.TRANSLATION_LOSS: "seed (unsupported)"}
    error = b'{"error": {"code": "upstream_error"}}'
    out, headers = answer(lua, error, status="502", md=loss)
    assert out == error and headers[Header.TRANSLATION_LOSS] == "seed (unsupported)"
    assert headers["content-type"] == "application/json; charset=utf-8"
    degraded = b'{"choices": []}'
    assert answer(lua, degraded, headers={Header.DEGRADED: "response"})[0] == degraded
    # A request the decision did not translate: nothing happens.
    out, headers = answer(lua, b"not json", shape="")
    assert out == b"not json" and headers[":status"] == "200" and Header.TRANSLATION_LOSS not in headers


def test_the_request_gets_the_shapes_headers_and_the_metadata_keeps_no_credential(lua: Any) -> None:
    native = {":path": "/v1/messages", "x-api-key": "sk-secret", "anthropic-version": "2023-06-01"}
    hdrs, sets = lua.globals().run_request(lua_table(lua, {Key.UPSTREAM_HEADERS: native}),
                                           lua_table(lua, {":path": "/v1/chat/completions", "x-api-key": "client"}))
    assert {k.decode(): v.decode() for k, v in hdrs.items()} == native
    assert {k.decode(): v for k, v in sets.items()} == {Key.UPSTREAM_HEADERS: b""}
    untouched, sets = lua.globals().run_request(lua_table(lua, {}), lua_table(lua, {":path": "/v1/chat/completions"}))
    assert dict(untouched.items()) == {b":path": b"/v1/chat/completions"} and not dict(sets.items())


# -- streams ----------------------------------------------------------------------------------------

def sse_event(doc: dict[str, Any]) -> bytes:
    return f"event: {doc['type']}\ndata: {json.dumps(doc)}\n\n".encode()


@st.composite
def anthropic_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A Messages stream's events, as the API sends them: text, thinking and tool-use blocks, their
    deltas (a tool's input as pieces of its JSON), pings anywhere, the stop reason and usage."""
    input_usage = {"input_tokens": st.integers(0, 10**6)}
    input_optional = {"cache_read_input_tokens": counts, "cache_creation_input_tokens": counts,
                      "cache_creation": st.fixed_dictionaries({"ephemeral_5m_input_tokens": counts,
                                                               "ephemeral_1h_input_tokens": counts})}

    def consistent(u: dict[str, Any]) -> dict[str, Any]:
        """A split by TTL never holds more than the writes (an answer whose does is broken: tested apart)."""
        if "cache_creation" in u:
            written = u.get("cache_creation_input_tokens") or 0
            hour = u["cache_creation"]["ephemeral_1h_input_tokens"] or 0
            u["cache_creation"]["ephemeral_1h_input_tokens"] = min(hour, written)
        return u
    usage = consistent(draw(st.fixed_dictionaries({**input_usage, "output_tokens": st.integers(0, 9)},
                                                  optional=input_optional)))
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {
        "id": draw(text), "type": "message", "role": "assistant", "model": draw(st.text(min_size=1, max_size=10)),
        "content": [], "stop_reason": None, "usage": usage}}]
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["text", "thinking", "tool_use"]), max_size=4))):
        if kind == "tool_use":
            events.append({"type": "content_block_start", "index": i, "content_block": {
                "type": "tool_use", "id": draw(text), "name": draw(text), "input": {}}})
            args = json.dumps(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)))
            cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=3)))
            pieces = [args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
            events += [{"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": piece}} for piece in pieces]
        else:
            events.append({"type": "content_block_start", "index": i, "content_block": {"type": kind, kind: ""}})
            events += [{"type": "content_block_delta", "index": i, "delta": {"type": f"{kind}_delta", kind: t}}
                       for t in draw(st.lists(text, max_size=3))]
            if kind == "thinking" and draw(st.booleans()):  # the block's signature, last
                events.append({"type": "content_block_delta", "index": i,
                               "delta": {"type": "signature_delta", "signature": draw(text)}})
        events.append({"type": "content_block_stop", "index": i})
        if draw(st.booleans()):
            events.append({"type": "ping"})
    # The input counts again, cumulative, as the API sends them now (or the output's alone, as it did).
    again = consistent(draw(st.one_of(st.just({}), st.fixed_dictionaries(input_usage, optional=input_optional))))
    events.append({"type": "message_delta", "delta": {"stop_reason": draw(st.sampled_from([*STOP_REASONS, "new"]))},
                   "usage": {**again, "output_tokens": draw(st.integers(0, 10**6))}})
    events.append({"type": "message_stop"})
    return events


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


def lua_stream(lua: Any, chunks: list[bytes], shape: str = "anthropic",
               empty_end: bool = True) -> tuple[bytes, dict[str, str]]:
    """What the stream guard after the Lua filter gets: the chunks as translated. The end of the stream
    is an empty last chunk (an HTTP/1 upstream's terminating chunk) or, `empty_end` false, comes with
    the last chunk's bytes (a whole answer in one frame)."""
    meta = {Key.ANSWER_SHAPE: shape, Key.ANSWER_MODEL: MODEL, Key.PLAN_STREAM: "1", Key.REQUEST_ID: REQUEST_ID}
    hdrs = {":status": "200", "content-type": "text/event-stream; charset=utf-8", "content-length": "99"}
    frames = [*chunks, b""] if empty_end or not chunks else chunks
    outs, got = lua.globals().run_stream(lua_table(lua, meta), lua_table(lua, hdrs), lua.table_from(frames))
    body = b"".join(outs[i] for i in range(1, len(frames) + 1))
    return body, {k.decode(): v.decode() for k, v in got.items()}


def python_stream(chunks: list[bytes], adapter: Adapter = ANTHROPIC) -> bytes:
    """What the attempt filter makes of the same chunks (extproc/service/attempts.py `_translate_chunk`)."""
    translator = adapter.stream(include_usage=True)
    translator.model = MODEL
    out: list[bytes] = []
    try:
        for c in chunks:
            out += translator.feed(c)
        out += translator.finish()
    except UpstreamBroken as e:
        out += e.partial
        out.append(b"data: " + json.dumps({"error": {"code": "stream_interrupted"}}).encode() + b"\n\n")
    return b"".join(out)


def events_of(body: bytes) -> list[Any]:
    """The data events (SSE comments dropped), parsed; `created` left out, an interruption as its code."""
    out: list[Any] = []
    for event in body.decode().split("\n\n"):
        if not event.startswith("data: "):
            continue
        data = event.removeprefix("data: ")
        doc = data if data == "[DONE]" else json.loads(data)
        if isinstance(doc, dict):
            doc.pop("created", None)
            if "error" in doc:
                doc = {"interrupted": doc["error"]["code"]}
        out.append(doc)
    return out


@settings(max_examples=200, deadline=None)
@given(anthropic_streams(), st.lists(st.integers(0, 4000), max_size=6), st.sampled_from(["whole", "cut", "error"]))
def test_the_lua_stream_translation_is_the_python_adapters(lua: Any, events: list[dict[str, Any]], cuts: list[int],
                                                          ending: str) -> None:
    if ending == "cut":  # the provider's stream ends before message_stop
        events = events[:-1]
    elif ending == "error":  # the provider reports an error mid-stream
        events = [*events[:-2], {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}]
    data = b"".join(sse_event(e) for e in events)
    chunks = split(data, cuts)
    out, headers = lua_stream(lua, chunks)
    assert headers["content-type"] == "text/event-stream" and "content-length" not in headers
    assert events_of(out) == events_of(python_stream(chunks))
    got = events_of(out)
    if ending == "whole":
        assert got[-1] == "[DONE]" and "usage" in got[-2]
    else:
        assert got[-1] == {"interrupted": "stream_interrupted"}
    # Every chunk that completed no event passed as a comment, never empty (the guard's end).
    assert b"".join(c for c in chunks) == data


@pytest.mark.parametrize("bad", [b"data: not json\n\n", b"data: [1]\n\n",
                                 b'data: {"type":"content_block_delta","index":5,"delta":{"type":"input_json_delta",'
                                 b'"partial_json":"{"}}\n\n', b"data: " + b"x" * (1 << 20) + b"x"])
def test_a_broken_provider_stream_ends_with_the_contracts_interruption_and_nothing_after(lua: Any, bad: bytes) -> None:
    start = sse_event({"type": "message_start", "message": {"id": "m", "model": "claude", "usage": {}}})
    after = sse_event({"type": "message_stop"})
    out, _ = lua_stream(lua, [start, bad, after])
    got = events_of(out)
    assert got[-1] == {"interrupted": "stream_interrupted"} and got[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(got) == 2  # the role chunk, the interruption: nothing of the stop after it


@st.composite
def gemini_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Gemini's stream, as the API sends it: responses each holding the next parts of the first
    candidate (text, thoughts, whole function calls) and the usage so far; the last a finish reason -
    or a prompt blocked before any candidate."""
    head = {"responseId": draw(text), "modelVersion": draw(st.text(min_size=1, max_size=10))}
    meta = st.fixed_dictionaries({}, optional={k: counts for k in (
        "promptTokenCount", "candidatesTokenCount", "cachedContentTokenCount", "thoughtsTokenCount")})
    if draw(st.integers(0, 9)) == 0:
        return [{**head, "promptFeedback": {"blockReason": draw(st.sampled_from(["SAFETY", "OTHER"]))},
                 "usageMetadata": draw(meta)}]
    responses = []
    for _ in range(draw(st.integers(1, 5))):
        doc: dict[str, Any] = {**head, "candidates": [{"content": {"role": "model", "parts": draw(
            st.lists(gemini_parts, max_size=3))}, "index": 0}]}
        if draw(st.booleans()):
            doc["usageMetadata"] = draw(meta)
        responses.append(doc)
    responses[-1]["candidates"][0]["finishReason"] = draw(st.sampled_from([*gemini.FINISH_REASONS, "SOMETHING_NEW"]))
    return responses


def gemini_sse(doc: dict[str, Any], crlf: bool = True) -> bytes:
    return b"data: " + json.dumps(doc).encode() + (b"\r\n\r\n" if crlf else b"\n\n")


def gemini_comparable(events: list[Any], ids: bool) -> list[Any]:
    """Stream events with each call's arguments parsed; without the call ids where Python makes random
    ones (no response id) and the Lua filter names them after the request."""
    for e in events:
        for choice in e.get("choices") or () if isinstance(e, dict) else ():
            for call in choice["delta"].get("tool_calls") or ():
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                if not ids:
                    call.pop("id")
    return events


@settings(max_examples=200, deadline=None)
@given(gemini_streams(), st.lists(st.integers(0, 4000), max_size=6),
       st.sampled_from(["whole", "cut", "error", "after"]), st.booleans(), st.booleans())
def test_the_lua_gemini_stream_translation_is_the_python_adapters(lua: Any, responses: list[dict[str, Any]],
                                                                 cuts: list[int], ending: str, crlf: bool,
                                                                 empty_end: bool) -> None:
    if ending == "cut":  # the provider's stream ends before its finish
        responses = [r for r in responses[:-1]] or [{"responseId": "r", "candidates": []}]
    elif ending == "error":  # the provider reports an error mid-stream
        responses = [*responses[:-1], {"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message": "busy"}}]
    elif ending == "after":  # a response after the finished one
        responses = [*responses, {"responseId": "r", "candidates": []}]
    data = b"".join(gemini_sse(r, crlf) for r in responses)
    chunks = split(data, cuts)
    out, headers = lua_stream(lua, chunks, "gemini", empty_end)
    assert headers["content-type"] == "text/event-stream" and "content-length" not in headers
    ids = bool(responses[0].get("responseId"))
    got = gemini_comparable(events_of(out), ids)
    assert got == gemini_comparable(events_of(python_stream(chunks, GEMINI)), ids)
    if ending == "whole":
        assert got[-1] == "[DONE]" and "usage" in got[-2]
    else:
        assert got[-1] == {"interrupted": "stream_interrupted"}
    if not ids:
        named = [c["id"] for e in events_of(out) if isinstance(e, dict) for ch in e.get("choices") or ()
                 for c in ch["delta"].get("tool_calls") or ()]
        assert named == [f"call_{REQUEST_ID}_{n}" for n in range(len(named))]


def test_a_whole_gemini_stream_in_its_last_frame_still_ends_with_usage_and_done(lua: Any) -> None:
    """A provider that writes its whole (short) stream at once: Envoy hands the filter one chunk that
    ends the stream, with no empty frame after it. The usage and [DONE] join that chunk."""
    final = {"responseId": "r1", "candidates": [{"content": {"parts": [{"text": "hi"}]}, "finishReason": "STOP"}],
             "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}}
    out, _ = lua_stream(lua, [gemini_sse(final)], "gemini", empty_end=False)
    got = events_of(out)
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 1


def test_a_gemini_stream_ends_with_its_usage_and_done_on_the_last_frame(lua: Any) -> None:
    """Gemini's stream has no end event: the usage and [DONE] ride on the (empty) last frame."""
    final = {"responseId": "r1", "modelVersion": "gemini-x", "candidates": [
        {"content": {"parts": [{"text": "hi"}]}, "finishReason": "STOP"}],
        "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1, "thoughtsTokenCount": 2}}
    meta = {Key.ANSWER_SHAPE: "gemini", Key.ANSWER_MODEL: MODEL, Key.PLAN_STREAM: "1"}
    outs, _ = lua.globals().run_stream(lua_table(lua, meta), lua_table(lua, {":status": "200"}),
                                       lua.table_from([gemini_sse(final), b""]))
    first, last = events_of(outs[1]), events_of(outs[2])
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant", "content": ""}, {"content": "hi"}, {}]
    assert first[-1]["choices"][0]["finish_reason"] == "stop" and first[0]["model"] == "gemini-x"
    assert last[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                "prompt_tokens_details": {"cached_tokens": 0},
                                "completion_tokens_details": {"reasoning_tokens": 2}} and last[1] == "[DONE]"


@st.composite
def bedrock_streams(draw: st.DrawFn) -> list[tuple[str, dict[str, Any]]]:
    """ConverseStream's events, as Bedrock sends them: text, reasoning and tool-use blocks (a tool's input
    as pieces of its JSON), the stop reason, then the metadata event with the usage."""
    events: list[tuple[str, dict[str, Any]]] = [("messageStart", {"role": "assistant"})]
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["text", "reasoning", "tool"]), max_size=4))):
        if kind == "tool":
            # (a response_format schema's tool among them: its input is the answer's content)
            events.append(("contentBlockStart", {"contentBlockIndex": i, "start": {
                "toolUse": {"toolUseId": draw(text), "name": draw(text | st.just(bedrock.OUTPUT_TOOL))}}}))
            args = json.dumps(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)))
            cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=3)))
            events += [("contentBlockDelta", {"contentBlockIndex": i, "delta": {"toolUse": {"input": args[a:b]}}})
                       for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
        else:
            events += [("contentBlockDelta", {"contentBlockIndex": i, "delta": {"text": t} if kind == "text" else {
                "reasoningContent": {"text": t}}}) for t in draw(st.lists(text, max_size=3))]
        events.append(("contentBlockStop", {"contentBlockIndex": i}))
    events.append(("messageStop", {"stopReason": draw(st.sampled_from([*bedrock.STOP_REASONS, "something_new"]))}))
    usage = draw(st.fixed_dictionaries({"inputTokens": st.integers(0, 10**6), "outputTokens": st.integers(0, 10**6)},
                                       optional={"cacheReadInputTokens": counts, "cacheWriteInputTokens": counts}))
    events.append(("metadata", {"usage": usage, "metrics": {"latencyMs": 9}}))
    return events


def without_ids(events: list[Any]) -> list[Any]:
    """Bedrock's chunks: Python names them at random, the Lua filter after the request."""
    for e in events:
        if isinstance(e, dict):
            assert e.pop("id", None) is not None or "interrupted" in e
    return events


@settings(max_examples=200, deadline=None)
@given(bedrock_streams(), st.lists(st.integers(0, 4000), max_size=6),
       st.sampled_from(["whole", "cut", "throttled", "after", "crc", "half", "stray", "unstopped"]),
       st.integers(1, 30))
def test_the_lua_bedrock_stream_translation_is_the_python_adapters(lua: Any, events: list[tuple[str, dict[str, Any]]],
                                                                  cuts: list[int], ending: str, at: int) -> None:
    frames = [eventstream.event(kind, doc) for kind, doc in events]
    if ending == "cut":  # the provider's stream ends before its metadata event
        frames = frames[:-1]
    elif ending == "throttled":  # an exception message mid-stream; what follows it never reaches the client
        at = min(at, len(frames) - 1)
        frames = [*frames[:at], eventstream.exception("throttlingException", "Too many tokens"), *frames[at:]]
    elif ending == "unstopped":  # the metadata event without messageStop before it
        frames = [*frames[:-2], frames[-1]]
    elif ending == "stray":  # a tool input's piece for a block that never started
        at = min(at, len(frames) - 2)
        frames.insert(at, eventstream.event("contentBlockDelta", {"contentBlockIndex": 99, "delta": {
            "toolUse": {"input": "{"}}}))
    elif ending == "after":  # an event after the metadata
        frames.append(eventstream.event("contentBlockStop", {"contentBlockIndex": 0}))
    elif ending == "crc":  # a message whose CRC does not match
        frames[-1] = frames[-1][:-1] + bytes([frames[-1][-1] ^ 1])
    elif ending == "half":  # the stream ends inside a message
        frames.append(frames[0][:9])
    data = b"".join(frames)
    chunks = split(data, cuts)
    out, headers = lua_stream(lua, chunks, "bedrock")
    assert headers["content-type"] == "text/event-stream" and "content-length" not in headers
    got = events_of(out)
    assert all(e["id"] == f"chatcmpl-{REQUEST_ID}" for e in got if isinstance(e, dict) and "id" in e)
    assert without_ids(got) == without_ids(events_of(python_stream(chunks, BEDROCK)))
    if ending == "whole":
        assert got[-1] == "[DONE]" and "usage" in got[-2]
    else:
        assert got[-1] == {"interrupted": "stream_interrupted"}


sse_ish = st.text(alphabet='{}[]":,0123456789.e-truefalsnl \\u\r\n', max_size=60).map(
    lambda t: f"data: {t}\n\n".encode())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=80) | sse_ish, max_size=5),
       st.sampled_from(["anthropic", "gemini", "bedrock"]))
def test_any_stream_bytes_end_finished_or_interrupted_and_never_a_script_error(lua: Any, chunks: list[bytes],
                                                                                shape: str) -> None:
    out, _ = lua_stream(lua, chunks, shape)  # a script error raises here
    got = events_of(out)
    assert got and got[-1] in ("[DONE]", {"interrupted": "stream_interrupted"}), got
    assert all(isinstance(e, dict) and e["object"] == "chat.completion.chunk" for e in got[:-2]), got


def test_a_chunk_that_completes_no_event_passes_as_a_comment(lua: Any) -> None:
    start = sse_event({"type": "message_start", "message": {"id": "m", "model": "claude", "usage": {}}})
    meta = {Key.ANSWER_SHAPE: "anthropic", Key.ANSWER_MODEL: MODEL, Key.PLAN_STREAM: "1"}
    outs, _ = lua.globals().run_stream(lua_table(lua, meta), lua_table(lua, {":status": "200"}), lua.table_from(
        [start[:10], start[10:], sse_event({"type": "ping"}), b""]))
    assert outs[1] == b":\n\n" and outs[2].startswith(b"data: ") and outs[3] == b":\n\n"


def test_an_event_after_the_stop_breaks_the_stream_as_in_the_adapter(lua: Any) -> None:
    events = [{"type": "message_start", "message": {"id": "m", "model": "claude", "usage": {}}},
              {"type": "message_stop"}, {"type": "ping"}]
    chunks = [b"".join(sse_event(e) for e in events)]
    got = events_of(lua_stream(lua, chunks)[0])
    assert got[-2:] == ["[DONE]", {"interrupted": "stream_interrupted"}] and got == events_of(python_stream(chunks))


COUNTED = {  # each shape's answer with its first count to be filled in
    "anthropic": b'{"type":"message","content":[],"usage":{"input_tokens":%s,"output_tokens":1}}',
    "gemini": b'{"candidates":[],"usageMetadata":{"promptTokenCount":%s}}',
    "bedrock": b'{"output":{"message":{"content":[]}},"usage":{"inputTokens":%s,"outputTokens":1}}'}


@pytest.mark.parametrize("shape", COUNTED)
@pytest.mark.parametrize("tokens", [b"-5", b"2.5", b"1e300", b"9007199254740993e3", b'"7"', b"true", b"{}"])
def test_a_count_no_provider_would_give_is_a_broken_answer(lua: Any, shape: str, tokens: bytes) -> None:
    """In Lua and in the Python adapter alike (the attempt filter's path, and the doors')."""
    body = COUNTED[shape] % tokens
    out, headers = answer(lua, body, shape=shape)
    assert headers[":status"] == "502" and json.loads(out or b"")["error"]["code"] == "upstream_error"
    with pytest.raises(UpstreamBroken):
        SHAPES[shape][1].response(200, body)
    assert answer(lua, COUNTED[shape] % b"5", shape=shape)[1][":status"] == "200"  # a count is one
