"""The Lua door filter (extproc/lua/doors.lua, as the renderer renders it) under LuaJIT (lupa's build),
held to the Python doors (each shape's door.py in extproc/shapes/: the reference its translations
were first built and tested on with the real SDKs): generated chat completions, errors and internal
streams split at random points come out of both the same. Through real Envoy it is tested by
tests/e2e/doors/test_anthropic_door_e2e.py and tests/e2e/doors/test_gemini_door_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.names import Key
from extproc.shapes.door import Door
from extproc.shapes.registry import DOORS_BY_NAME
from llmgw.render.filters import doors_lua
from tests.lua_harness import lua_runtime, lua_table
from tests.oracles import door_oracle
from tests.oracles.base import UpstreamBroken

DOORS = ("anthropic", "gemini", "responses")
NAMED_EVENTS = ("anthropic", "responses")  # `event: <name>` lines before each event's data


@pytest.fixture(scope="module")
def lua() -> Any:
    return lua_runtime(doors_lua())


def lua_answer(lua: Any, door: str, status: int, body: bytes) -> tuple[int, bytes, dict[bytes, Any]]:
    """(status, body, metadata set) of what the caller gets."""
    hdrs = {":status": str(status), "content-type": "application/json", "content-length": str(len(body))}
    out, got, sets = lua.globals().run_response(lua_table(lua, {Key.DOOR: door}), lua_table(lua, hdrs), body)
    headers = {k.decode(): v.decode() for k, v in got.items()}
    assert "content-length" not in headers
    return int(headers[":status"]), out, dict(sets.items())


def python_answer(door: Door, status: int, body: bytes) -> tuple[int, bytes]:
    """What the door filter in ext_proc made of the same (extproc/door_filter.py before the Lua filter)."""
    if not 200 <= status < 300:
        return status, door.error(status, body)
    try:
        return status, json.dumps(door_oracle(door).answer(json.loads(body))).encode()
    except (ValueError, AttributeError, TypeError, KeyError, IndexError, UpstreamBroken):
        return 502, door.error(502, json.dumps({"error": {"message": "the upstream's answer could not be read",
                                                           "code": "upstream_error"}}).encode())


def parsed(body: bytes) -> Any:
    """A body parsed, tool inputs and call arguments parsed too (the Lua filter keeps the JSON text as
    written, Python writes it again)."""
    return json.loads(body)


text = st.text(max_size=12)
args_objects = st.dictionaries(st.text(max_size=5), st.integers() | text | st.booleans(), max_size=3)
arguments = args_objects.map(json.dumps) | st.sampled_from(["", "{", "[1]", "7", "not json"])
counts = st.none() | st.integers(0, 10**9)
usages = st.fixed_dictionaries({"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**6)},
                               optional={"prompt_tokens_details": st.none() | st.fixed_dictionaries(
                                   {}, optional={"cached_tokens": counts}),
                                   "completion_tokens_details": st.none() | st.fixed_dictionaries(
                                       {}, optional={"reasoning_tokens": counts})})
calls = st.fixed_dictionaries({"id": text, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text, "arguments": arguments})})
messages = st.fixed_dictionaries({"role": st.just("assistant")}, optional={
    "content": st.none() | text, "tool_calls": st.lists(calls, max_size=3),
    # a reasoning model's thoughts (vLLM's older name too), and a provider's signature over them
    "reasoning": st.none() | text | st.integers(), "reasoning_content": st.none() | text,
    "reasoning_signature": st.none() | text | st.integers()})
finishes = st.sampled_from(["stop", "length", "tool_calls", "content_filter", "something_new"])
choices = st.fixed_dictionaries({"message": messages, "finish_reason": finishes},
                                optional={"stop_reason": st.none() | text})
completions = st.fixed_dictionaries({"id": text.map(lambda t: "chatcmpl-" + t), "object": st.just("chat.completion"),
                                     "created": st.just(1), "model": text,
                                     "choices": st.lists(choices, min_size=1, max_size=2).map(
                                         lambda cs: [{**c, "index": i} for i, c in enumerate(cs)])},
                                    optional={"usage": usages})


@pytest.mark.parametrize("door", DOORS)
def test_a_chat_completion_reaches_the_caller_as_the_python_door_wrote_it(lua: Any, door: str) -> None:
    @settings(max_examples=300, deadline=None)
    @given(completions, st.booleans())
    def translates_alike(doc: dict[str, Any], ascii_only: bool) -> None:
        body = json.dumps(doc, ensure_ascii=ascii_only).encode()
        status, out, sets = lua_answer(lua, door, 200, body)
        want_status, want = python_answer(DOORS_BY_NAME[door], 200, body)
        assert (status, parsed(out)) == (want_status, parsed(want))
        assert sets == {}

    translates_alike()


error_bodies = st.one_of(
    st.fixed_dictionaries({"error": st.fixed_dictionaries(
        {"message": text, "type": st.just("invalid_request_error"), "code": st.sampled_from(
            ["invalid_request", "budget_exhausted", "upstream_error"])},
        optional={"param": st.none() | text})}).map(json.dumps),
    st.just(json.dumps({"type": "error", "error": {"type": "api_error", "message": "kept", "code": "x"}})),
    st.just(json.dumps({"error": {"code": 429, "message": "kept", "status": "RESOURCE_EXHAUSTED"}})),
    st.sampled_from(["", "not json", "[]", '{"error": "text"}']),
)


@pytest.mark.parametrize("door", DOORS)
def test_an_error_reaches_the_caller_in_its_shape_as_the_python_door_wrote_it(lua: Any, door: str) -> None:
    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from([400, 401, 403, 404, 413, 429, 500, 502, 503, 504, 529]), error_bodies)
    def errors_alike(status: int, body: str) -> None:
        got_status, out, _ = lua_answer(lua, door, status, body.encode())
        want_status, want = python_answer(DOORS_BY_NAME[door], status, body.encode())
        assert (got_status, parsed(out)) == (want_status, parsed(want))

    errors_alike()


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("count", ["-7", "2.5", '"7"', "true"])
def test_an_answer_the_door_cannot_carry_is_its_502_and_charged(lua: Any, door: str, count: str) -> None:
    """The status too: the Lua filter holds the headers until it has read the body (the ext_proc door
    filter could only put the error under the 200 already sent). Settlement charges the whole
    reservation: the upstream did the work."""
    body = ('{"id":"chatcmpl-1","model":"m","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}],'
            '"usage":{"prompt_tokens":3,"completion_tokens":' + count + "}}").encode()
    status, out, sets = lua_answer(lua, door, 200, body)
    assert status == 502 and "upstream_error" in out.decode() and sets == {Key.ANSWER_BROKEN.encode(): b"1"}
    assert python_answer(DOORS_BY_NAME[door], 200, body)[0] == 502


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet='{}[]":,0123456789.e-truefalsnl \\u', max_size=80).map(str.encode),
       st.sampled_from(DOORS), st.sampled_from([200, 400, 502]))
def test_any_body_is_an_answer_or_an_error_and_never_a_script_error(lua: Any, body: bytes, door: str,
                                                                    status: int) -> None:
    got_status, out, _ = lua_answer(lua, door, status, body)
    assert isinstance(json.loads(out), dict) and got_status in (200, status, 502)


# -- streams ----------------------------------------------------------------------------------------

def chunk(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


@st.composite
def internal_streams(draw: st.DrawFn) -> list[bytes]:
    """The internal stream as the stream guard passes it to the door: the role chunk, text deltas,
    tool calls (the first delta names the call, the next carry pieces of its arguments), the finish,
    the usage chunk, [DONE]; keep-alive comments anywhere."""
    head = {"id": "chatcmpl-" + draw(text), "object": "chat.completion.chunk", "created": 1, "model": draw(text)}

    def delta(d: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return chunk({**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish,
                                            **extra}]})

    out = [delta({"role": "assistant", "content": ""})]
    for n, kind in enumerate(draw(st.lists(st.sampled_from(["reasoning", "text", "tool"]), max_size=4))):
        if kind == "reasoning":
            name = draw(st.sampled_from(["reasoning", "reasoning_content"]))
            out += [delta({name: t}) for t in draw(st.lists(text, max_size=3))]
            if draw(st.booleans()):
                out.append(delta({"reasoning_signature": draw(text)}))
        elif kind == "text":
            out += [delta({"content": t}) for t in draw(st.lists(text, max_size=3))]
        else:
            args = draw(arguments)
            cuts = sorted(draw(st.lists(st.integers(0, len(args)), max_size=2)))
            pieces = [args[a:b] for a, b in zip([0, *cuts], [*cuts, len(args)], strict=True)]
            out.append(delta({"tool_calls": [{"index": n, "id": draw(text), "type": "function",
                                              "function": {"name": draw(text), "arguments": ""}}]}))
            out += [delta({"tool_calls": [{"index": n, "function": {"arguments": p}}]}) for p in pieces]
        if draw(st.booleans()):
            out.append(b":\n\n")
    finish = draw(finishes)
    out.append(delta({}, finish, **({"stop_reason": draw(text)} if draw(st.booleans()) else {})))
    if draw(st.booleans()):
        out.append(chunk({**head, "choices": [], "usage": draw(usages)}))
    out.append(b"data: [DONE]\n\n")
    return out


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True) if b > a]


def lua_stream(lua: Any, door: str, chunks: list[bytes], empty_end: bool = True) -> bytes:
    """The door's events for the chunks; the stream's end an empty last chunk or, `empty_end` false,
    the last chunk itself (the filter before it wrote into the empty end, or the whole answer came in
    one frame)."""
    hdrs = {":status": "200", "content-type": "text/event-stream"}
    frames = [*chunks, b""] if empty_end or not chunks else chunks
    outs, _ = lua.globals().run_stream(lua_table(lua, {Key.DOOR: door}), lua_table(lua, hdrs),
                                       lua.table_from(frames))
    return b"".join(outs[i] for i in range(1, len(frames) + 1))


def python_stream(door: str, chunks: list[bytes]) -> bytes:
    stream = door_oracle(DOORS_BY_NAME[door]).stream()
    return b"".join(stream.feed(c) for c in chunks) + stream.finish()


def events(door: str, body: bytes) -> list[Any]:
    """The caller's events, parsed: Anthropic's (name, data), Gemini's data; tool inputs parsed."""
    sep = "\r\n\r\n" if door == "gemini" else "\n\n"
    out: list[Any] = []
    for e in body.decode().split(sep):
        if not e:
            continue
        if door in NAMED_EVENTS:
            name, data = e.split("\n", 1)
            out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        else:
            out.append(json.loads(e.removeprefix("data: ")))
    return out


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DOORS), internal_streams(), st.lists(st.integers(0, 3000), max_size=6),
       st.sampled_from(["done", "interrupted", "cut", "malformed"]), st.booleans())
def test_a_stream_reaches_the_caller_as_the_python_door_wrote_it(lua: Any, door: str, stream: list[bytes],
                                                                cuts: list[int], ending: str, empty_end: bool) -> None:
    if ending == "interrupted":  # the stream guard's (or an upstream's) interruption
        stream = [*stream[:-2], b'data: {"error": {"code": "stream_interrupted", "message": "cut \\"short\\""}}\n\n']
    elif ending == "cut":  # an end before [DONE]
        stream = stream[:-1]
    elif ending == "malformed":
        stream = [*stream[:-2], b"data: {not json\n\n", stream[-1]]
    chunks = split(b"".join(stream), cuts)
    got = events(door, lua_stream(lua, door, chunks, empty_end))
    assert got == events(door, python_stream(door, chunks))
    last = got[-1]
    if ending == "done":
        assert ENDED[door](last)
    else:
        assert INTERRUPTED[door](last)


# The last event of a stream that ended normally, and of one that did not, in each door's shape.
ENDED: dict[str, Any] = {
    "anthropic": lambda last: last[0] == "message_stop",
    "gemini": lambda last: "finishReason" in last.get("candidates", [{}])[0],
    "responses": lambda last: last[0] in ("response.completed", "response.incomplete")}
INTERRUPTED: dict[str, Any] = {
    "anthropic": lambda last: last[0] == "error" and last[1]["error"]["code"] == "stream_interrupted",
    "gemini": lambda last: "error" in last and last["error"]["details"][0]["reason"] == "stream_interrupted",
    "responses": lambda last: last[0] == "response.failed"
    and last[1]["response"]["error"]["code"] == "stream_interrupted"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=80) | st.text(
    alphabet='{}[]":,0123456789.e-truefalsnl \\u\r\n', max_size=60).map(lambda t: f"data: {t}\n\n".encode()),
    max_size=5), st.sampled_from(DOORS))
def test_any_stream_ends_finished_or_with_the_doors_error_and_never_a_script_error(lua: Any, chunks: list[bytes],
                                                                                   door: str) -> None:
    last = events(door, lua_stream(lua, door, chunks))[-1]  # a script error raises here
    assert ENDED[door](last) or INTERRUPTED[door](last)


@pytest.mark.parametrize("door, named", [("anthropic", "request-id"), ("gemini", None), ("responses", None)])
def test_the_request_id_is_where_the_doors_sdk_reads_it(lua: Any, door: str, named: str | None) -> None:
    """The anthropic SDK reads `request-id` (`message._request_id`): the decision's request id, which
    Envoy's x-request-id and the ledger carry too."""
    body = json.dumps({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "hi"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    hdrs = {":status": "200", "content-type": "application/json"}
    md = {Key.DOOR: door, Key.REQUEST_ID: "rid-7"}
    _, got, _ = lua.globals().run_response(lua_table(lua, md), lua_table(lua, hdrs), body)
    headers = {k.decode(): v.decode() for k, v in got.items()}
    assert headers.get("request-id") == ("rid-7" if named else None)


@pytest.mark.parametrize("door, want", [
    ("anthropic", {"input_tokens": 21}),
    ("gemini", {"totalTokens": 21, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": 21}]}),
])
@pytest.mark.parametrize("shape, field", [("openai", "count"), ("anthropic", "input_tokens"), ("gemini", "totalTokens"),
                                          ("bedrock", "inputTokens")])
def test_a_token_count_reaches_the_caller_in_its_doors_shape(lua: Any, door: str, want: dict[str, Any], shape: str,
                                                             field: str) -> None:
    """Whichever shape counted (the engine's /tokenize, a provider's own count), the count is read from
    that shape's field and answered in the door's; it is the request's prompt tokens for its ledger entry."""
    body = json.dumps({field: 21, "max_model_len": 8192} if shape == "openai" else {field: 21}).encode()
    hdrs = {":status": "200", "content-type": "application/json"}
    out, got, sets = lua.globals().run_response(lua_table(lua, {Key.DOOR: door, Key.COUNT: shape}),
                                                lua_table(lua, hdrs), body)
    assert json.loads(out) == want and got[b":status"] == b"200"
    assert sets[Key.USAGE_PROMPT.encode()] == 21 and Key.ANSWER_BROKEN.encode() not in sets


@pytest.mark.parametrize("door", [d for d in DOORS if DOORS_BY_NAME[d].count_path])  # (the doors that count)
@pytest.mark.parametrize("body", [b'{"input_tokens": -1}', b'{"input_tokens": 2.5}', b"{}", b"not json",
                                  b'{"input_tokens": "21"}'])
def test_a_count_that_cannot_be_read_is_the_doors_502(lua: Any, door: str, body: bytes) -> None:
    hdrs = {":status": "200", "content-type": "application/json"}
    _, got, sets = lua.globals().run_response(lua_table(lua, {Key.DOOR: door, Key.COUNT: "anthropic"}),
                                              lua_table(lua, hdrs), body)
    assert got[b":status"] == b"502" and sets[Key.ANSWER_BROKEN.encode()] == b"1"


# Where each door's answer names its model.
MODEL_OF: dict[str, Any] = {"anthropic": lambda doc: doc["model"], "gemini": lambda doc: doc["modelVersion"],
                            "responses": lambda doc: doc["model"]}


@pytest.mark.parametrize("door", DOORS)
def test_the_answer_names_the_model_the_guard_left(lua: Any, door: str) -> None:
    """The stream guard names the route the caller asked for as the internal answer's model (tests/lua/
    test_lua_stream_guard.py); every door's answer and stream carry that name where its shape has one."""
    body = json.dumps({"id": "chatcmpl-1", "model": "chat-anthropic", "choices": [{"index": 0, "finish_reason": "stop",
                       "message": {"role": "assistant", "content": "hi"}}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    md = {Key.DOOR: door, Key.ROUTE: "chat-anthropic"}
    out, _, _ = lua.globals().run_response(lua_table(lua, md), lua_table(lua, {
        ":status": "200", "content-type": "application/json"}), body)
    assert MODEL_OF[door](json.loads(out)) == "chat-anthropic"
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "chat-anthropic"}
    frames = [chunk({**head, "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}),
              chunk({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              b"data: [DONE]\n\n", b""]
    outs, _ = lua.globals().run_stream(lua_table(lua, md), lua_table(lua, {
        ":status": "200", "content-type": "text/event-stream"}), lua.table_from(frames))
    streamed = b"".join(outs[i] for i in range(1, len(frames) + 1))
    assert b"chat-anthropic" in streamed


def test_a_call_in_a_namespace_is_answered_with_its_namespace(lua: Any) -> None:
    """The Responses door sends a namespace's functions as `namespace__function` (extproc/shapes/openai/
    door.py); a call to one is answered as the function in its namespace, JSON and stream, as Codex reads
    it. A name with `__` that is no namespace of the request (an MCP tool's) is left as it is."""
    def call(i: int, name: str) -> dict[str, Any]:
        return {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": "{}"}}
    names = ["multi_agent_v1__spawn_agent", "mcp__docs__search"]
    body = json.dumps({"id": "chatcmpl-1", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
                       "message": {"role": "assistant", "content": None,
                                   "tool_calls": [call(i, n) for i, n in enumerate(names)]}}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    md = {Key.DOOR: "responses", Key.NAMESPACES: "multi_agent_v1,other"}
    out, _, _ = lua.globals().run_response(lua_table(lua, md), lua_table(lua, {
        ":status": "200", "content-type": "application/json"}), body)
    items = json.loads(out)["output"]
    assert [(i["name"], i.get("namespace")) for i in items] == [("spawn_agent", "multi_agent_v1"),
                                                                ("mcp__docs__search", None)]
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    frames = [chunk({**head, "choices": [{"index": 0, "delta": {"tool_calls": [call(0, names[0])]},
                                          "finish_reason": None}]}),
              chunk({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
              b"data: [DONE]\n\n", b""]
    outs, _ = lua.globals().run_stream(lua_table(lua, md), lua_table(lua, {
        ":status": "200", "content-type": "text/event-stream"}), lua.table_from(frames))
    events = [json.loads(line[6:]) for line in b"".join(outs[i] for i in range(1, len(frames) + 1)).decode(
        ).splitlines() if line.startswith("data: ")]
    added = next(e for e in events if e["type"] == "response.output_item.added")
    done = next(e for e in events if e["type"] == "response.output_item.done")
    for item in (added["item"], done["item"]):
        assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    # Without the request's namespaces, nothing is split.
    out, _, _ = lua.globals().run_response(lua_table(lua, {Key.DOOR: "responses"}), lua_table(lua, {
        ":status": "200", "content-type": "application/json"}), body)
    assert [i["name"] for i in json.loads(out)["output"]] == names
