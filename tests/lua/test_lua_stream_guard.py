"""The Lua stream guard's logic (extproc/lua/stream_guard.lua, as the renderer renders it), run under
LuaJIT (lupa's build) with a stand-in for Envoy's stream handle: chunks in, chunks and metadata out.
Through real Envoy it is tested by tests/e2e/routing/test_streams_e2e.py and
tests/e2e/routing/test_stream_limits_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lupa import luajit21

from extproc.contract import interrupted_event
from extproc.names import INTERRUPTED, KEEPALIVE, Key, StreamEnd
from llmgw.render.bootstrap import stream_guard_lua
from tests.lua_harness import BODY_CHUNKS, ENVOY_GLOBALS

# Envoy's handle as the script uses it: metadata get/set in one namespace, the response status, a
# clock (`now`, epoch ms: one, or each chunk's), and the body as chunks (each one's bytes may be
# replaced; an empty one ends the stream).
HARNESS = ENVOY_GLOBALS + BODY_CHUNKS + """
function run_guard(chunks, md, status, now, content_type)
  local sets, outs = {}, {}
  local hdrs = {[":status"] = status, ["content-type"] = content_type, ["content-length"] = "123"}
  local dm = {get = function(self, ns) return md end,
              set = function(self, ns, k, v) sets[k] = v; md[k] = v end}
  local si = {dynamicMetadata = function(self) return dm end}
  local at = 0  -- the chunk being read: `now` is one time, or a list of the time each chunk came
  local function clock() if type(now) == "number" then return now end return now[at] or 0 end
  local h = {
    streamInfo = function(self) return si end,
    headers = function(self)
      return {get = function(self, k) return hdrs[k] end, remove = function(self, k) hdrs[k] = nil end,
              replace = function(self, k, v) hdrs[k] = v end}
    end,
    timestamp = function(self) return clock() end,
    timestampString = function(self, resolution)
      return string.format("%d", resolution == EnvoyTimestampResolution.MICROSECOND and clock() * 1000 or clock())
    end,
    bodyChunks = function(self)
      local next_chunk = body_chunks(chunks, outs)
      return function() at = at + 1; return next_chunk() end
    end,
    body = function(self)  -- a JSON answer read whole: the chunks joined
      local whole = table.concat(chunks)
      return {length = function(self) return #whole end, getBytes = function(self, i, n) return whole end,
              setBytes = function(self, b) outs.body = b end}
    end,
  }
  envoy_on_response(h)
  return outs, sets, hdrs
end
"""


@pytest.fixture(scope="module")
def lua() -> Any:
    runtime = luajit21.LuaRuntime(unpack_returned_tuples=True, encoding=None)  # Lua strings as bytes
    runtime.execute(stream_guard_lua())
    runtime.execute(HARNESS)
    return runtime


def guard(lua: Any, chunks: list[bytes], *, withhold: bool = False, status: str = "200", now: int | list[int] = 0,
          ends_at: int | None = None, settle: str = "stream", content_type: str = "text/event-stream",
          headers: dict[str, str] | None = None, route: str = "") -> tuple[bytes, dict[str, Any]]:
    """What the client receives and the metadata the guard set; `headers` gets the response headers
    as the guard left them."""
    md = {Key.SETTLE: settle, **({Key.WITHHOLD_USAGE: "1"} if withhold else {}),
          **({Key.ROUTE: route} if route else {}),
          **({Key.STREAM_ENDS_AT_MS: str(ends_at)} if ends_at is not None else {})}
    outs, sets, hdrs = lua.globals().run_guard(lua.table_from(chunks), lua.table_from(
        {k.encode(): v.encode() for k, v in md.items()}), status.encode(),
        lua.table_from(now) if isinstance(now, list) else now, content_type.encode())
    if headers is not None:
        headers.update({k.decode(): v.decode() for k, v in hdrs.items()})
    if outs[b"body"] is not None:  # a JSON answer the script rewrote whole
        return outs[b"body"], {k.decode(): v for k, v in sets.items()}
    # A chunk the script never took (it returned at once) passes as it came.
    out = b"".join(chunks[i - 1] if outs[i] is None else outs[i] for i in range(1, len(chunks) + 1))
    return out, {k.decode(): v.decode() if isinstance(v, bytes) else v for k, v in sets.items()}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(text: str) -> bytes:
    return event({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                  "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]})


ROLE = event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
USAGE = event({"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                   "prompt_tokens_details": {"cached_tokens": 2}}})
DONE = b"data: [DONE]\n\n"
FINISH = event({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
STREAM = ROLE + token("a") + token(" b") + token(" c") + FINISH + USAGE + DONE


def interrupted(end: StreamEnd) -> bytes:
    return interrupted_event(INTERRUPTED[end])


@pytest.mark.parametrize("withhold", [False, True])
def test_a_whole_stream_passes_with_its_usage_in_the_metadata(lua: Any, withhold: bool) -> None:
    out, sets = guard(lua, [STREAM, b""], withhold=withhold)
    assert out == (STREAM.replace(USAGE, b"") if withhold else STREAM)
    assert sets == {Key.USAGE_PROMPT: 7, Key.USAGE_COMPLETION: 3, Key.USAGE_CACHED: 2, Key.STREAM_CHUNKS: 3,
                    Key.STREAM_END: StreamEnd.DONE, Key.UPSTREAM_ID: "c", Key.FINISH_REASON: "stop",
                    Key.FIRST_TOKEN_AT_US: "0"}


def test_the_classes_priced_apart_reach_the_metadata_when_the_usage_has_them(lua: Any) -> None:
    """Cache writes (by TTL) and reasoning tokens, each priced at its own rate: the access log gets them."""
    usage = event({"id": "c", "choices": [], "usage": {
        "prompt_tokens": 70, "completion_tokens": 30, "prompt_tokens_details": {
            "cached_tokens": 5, "cache_write_tokens": 20, "cache_write_1h_tokens": 40},
        "completion_tokens_details": {"reasoning_tokens": 12}}})
    _, sets = guard(lua, [ROLE + token("a") + FINISH + usage + DONE, b""], withhold=True)
    assert (sets[Key.USAGE_PROMPT], sets[Key.USAGE_CACHED], sets[Key.USAGE_COMPLETION]) == (70, 5, 30)
    assert (sets[Key.USAGE_CACHE_WRITE], sets[Key.USAGE_CACHE_WRITE_1H], sets[Key.USAGE_REASONING]) == (20, 40, 12)


@pytest.mark.parametrize("first", [
    token("a"),
    event({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}),
    event({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
])
def test_the_first_token_is_stamped_when_the_first_content_comes_not_the_headers_or_the_role(
        lua: Any, first: bytes) -> None:
    """An engine sends its headers and an empty role chunk before it queues and prefills: the time to
    first token is the first chunk with content (text, a tool call, reasoning), in microseconds."""
    keepalive = b": keepalive\n\n"
    _, sets = guard(lua, [ROLE, keepalive, first, token(" b"), FINISH + DONE, b""],
                    now=[1_000, 1_200, 1_750, 1_760, 1_770, 1_780])
    assert sets[Key.FIRST_TOKEN_AT_US] == "1750000"
    _, sets = guard(lua, [ROLE, FINISH + DONE, b""], now=[1_000, 1_100, 1_200])
    assert Key.FIRST_TOKEN_AT_US not in sets  # nothing generated: no first token


@pytest.mark.parametrize(("first", "kept"), [
    (b'data: {"id":"chatcmpl-7","choices":[]}\n\n', "chatcmpl-7"),
    (b'data: {"id":"with \\" quote","choices":[]}\n\n', None),  # escapes: not kept (the ledger takes plain ids)
    (b'data: {"id":7,"choices":[]}\n\n', None),
    (b'data: {"id":"' + b"x" * 200 + b'","choices":[]}\n\n', None),
    (b'data: {"choices":[{"index":0,"delta":{"content":"\\"finish_reason\\": \\"fake\\""}}]}\n\n', None),
])
def test_the_upstream_id_and_finish_reason_only_as_the_upstream_wrote_them(lua: Any, first: bytes,
                                                                         kept: str | None) -> None:
    _, sets = guard(lua, [first + DONE, b""])
    assert sets.get(Key.UPSTREAM_ID) == kept and Key.FINISH_REASON not in sets


def test_events_split_anywhere_reach_the_client_whole(lua: Any) -> None:
    for cut in range(1, len(STREAM)):
        chunks = [STREAM[:cut], STREAM[cut:], b""]
        out, sets = guard(lua, chunks)
        # (a first chunk that completes no event passes as an SSE comment, never empty: see below)
        assert out in (STREAM, KEEPALIVE + STREAM) and sets[Key.STREAM_END] == StreamEnd.DONE
        # Nothing reaches the client before its event is complete. (Fed alone, the first chunk is also
        # the stream's end: the unfinished event the guard then adds is not what it let through.)
        first, _ = guard(lua, chunks[:1])
        first = first.removesuffix(interrupted(StreamEnd.UNFINISHED))
        assert first == KEEPALIVE or (STREAM.startswith(first) and first.endswith(b"\n\n"))


def test_a_chunk_that_completes_no_event_never_passes_empty(lua: Any) -> None:
    """A front door's Lua filter after the guard reads an empty chunk as the stream's end (and stops
    translating what follows): half an event, or the withheld usage chunk alone, passes as a comment."""
    half = len(ROLE) // 2
    chunks = [ROLE[:half], ROLE[half:] + token("a"), USAGE, DONE, b""]
    md = lua.table_from({Key.SETTLE.encode(): b"stream", Key.WITHHOLD_USAGE.encode(): b"1"})
    outs, _, _ = lua.globals().run_guard(lua.table_from(chunks), md, b"200", 0, b"text/event-stream")
    assert [outs[i] for i in range(1, 6)] == [KEEPALIVE, ROLE + token("a"), KEEPALIVE, DONE, b""]


def test_crlf_events_comments_and_multi_line_data(lua: Any) -> None:
    stream = b": keep-alive\r\n\r\n" + token("x").replace(b"\n\n", b"\r\n\r\n") + \
        b'data: {"choices":\ndata: [{"delta":{"content":"y"}}]}\n\n' + DONE
    out, sets = guard(lua, [stream, b""])
    assert out == stream and sets[Key.STREAM_CHUNKS] == 2 and sets[Key.STREAM_END] == StreamEnd.DONE


@pytest.mark.parametrize(("bad", "end"), [
    (b'data: {"id": "broken", "choices": [\n\n', StreamEnd.MALFORMED),
    (b"data: not json\n\n", StreamEnd.MALFORMED),
    (b"data: [1, 2]\n\n", StreamEnd.MALFORMED),
    (event({"error": {"message": "engine died", "code": 500}}), StreamEnd.ERROR),
])
def test_a_broken_event_ends_the_stream_with_the_contract_event(lua: Any, bad: bytes, end: StreamEnd) -> None:
    head = ROLE + token("a")
    out, sets = guard(lua, [head, bad + token("never"), DONE, b""])
    assert out == head + interrupted(end)  # nothing after it, [DONE] included
    assert sets[Key.STREAM_END] == end and sets[Key.STREAM_CHUNKS] == 1


@pytest.mark.parametrize("empty_end", [True, False])
def test_an_end_without_done_is_unfinished(lua: Any, empty_end: bool) -> None:
    """Also when the end comes with the last bytes (no empty chunk after them): the event joins them."""
    out, sets = guard(lua, [ROLE + token("a"), *([b""] if empty_end else [])])
    assert out == ROLE + token("a") + interrupted(StreamEnd.UNFINISHED)
    assert sets[Key.STREAM_END] == StreamEnd.UNFINISHED


def test_a_whole_stream_in_one_last_chunk_passes(lua: Any) -> None:
    out, sets = guard(lua, [STREAM])
    assert out == STREAM and sets[Key.STREAM_END] == "done"


def test_an_oversized_event_ends_the_stream(lua: Any) -> None:
    huge = b"data: {" + b" " * (1 << 20)
    out, sets = guard(lua, [ROLE, huge, b"}\n\n", b""])
    assert out == ROLE + interrupted(StreamEnd.OVERSIZED) and sets[Key.STREAM_END] == StreamEnd.OVERSIZED


def test_past_its_end_time_the_next_chunk_is_the_interrupted_event(lua: Any) -> None:
    out, sets = guard(lua, [ROLE, token("a"), DONE, b""], now=5_000, ends_at=4_000)
    assert out == interrupted(StreamEnd.OVER) and sets[Key.STREAM_END] == StreamEnd.OVER
    out, _ = guard(lua, [STREAM, b""], now=3_999, ends_at=4_000)
    assert out == STREAM


@pytest.mark.parametrize(("status", "settle"), [("502", "stream"), ("200", "als"), ("200", "kept_stream")])
def test_error_statuses_and_other_routes_pass_untouched(lua: Any, status: str, settle: str) -> None:
    body = b'{"error": {"code": "upstream_error"}}'
    out, sets = guard(lua, [body, b""], status=status, settle=settle)
    assert out == body and sets == {}


def test_what_counts_as_generated_content(lua: Any) -> None:
    chunks = [
        event({"choices": [{"delta": {"content": ""}}]}),  # empty: not counted
        event({"choices": [{"delta": {"content": " "}}]}),
        event({"choices": [{"delta": {"tool_calls": []}}]}),  # empty: not counted
        event({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
        event({"choices": [{"delta": {"reasoning_content": "hm"}}]}),
        event({"choices": [{"delta": {"reasoning": "hm"}}]}),
        event({"choices": [{"delta": {}, "logprobs": {"content": [{"token": "x"}]}}]}),  # not content
    ]
    _, sets = guard(lua, [b"".join(chunks) + DONE, b""])
    assert sets[Key.STREAM_CHUNKS] == 4


def strict_object(text: str) -> bool:
    """What the guard must accept: a JSON object, as a strict parser reads it (no NaN, no Infinity)."""
    def no_constants(name: str) -> Any:
        raise ValueError(name)
    try:
        return isinstance(json.loads(text, parse_constant=no_constants), dict)
    except ValueError:
        return False


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=5),
       st.sampled_from([(",", ":"), (", ", ": "), (" ,\t", "\t: ")]), st.data())
def test_the_json_check_agrees_with_a_strict_parser(lua: Any, doc: dict[str, Any], separators: tuple[str, str],
                                                    data: st.DataObject) -> None:
    """Generated objects, and the same text broken at one place (a byte dropped, replaced or added):
    the guard passes an event exactly when a strict JSON parser reads an object from it."""
    if data.draw(st.booleans()):  # a chunk's list of choices (most generated objects are no chunk)
        doc = {"choices": [], **doc}
    text = json.dumps(doc, separators=separators, ensure_ascii=data.draw(st.booleans()))
    if data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(text)))
        junk = data.draw(st.sampled_from(['"', "{", "}", "[", "]", ",", ":", "\\", "0", "-", ".", "e", "\x01", "n",
                                          "t", " ", "", "\\u12"]))
        text = text[:at] + junk + text[at + data.draw(st.integers(0, 1)):]
    _, sets = guard(lua, [f"data: {text}\n\n".encode() + DONE, b""])
    # An object whose top level holds `error` is the contract's error event, whatever its value; any
    # other object must be a chunk (a list of choices, or usage).
    error_event = strict_object(text) and "error" in json.loads(text)
    chunk = strict_object(text) and (isinstance(json.loads(text).get("choices"), list) or "usage" in json.loads(text))
    assert (sets[Key.STREAM_END] == StreamEnd.DONE) == (chunk and not error_event), text
    assert (sets[Key.STREAM_END] == StreamEnd.ERROR) == error_event, text


@pytest.mark.parametrize("text", [
    '{"a": 01}', '{"a": -01}', '{"a": 1.}', '{"a": .5}', '{"a": 1e}', '{"a": +1}', '{"a": NaN}', '{"a": Infinity}',
    '{"a": tru}', '{"a": nul}', '{"a": "\\x"}', '{"a": "\\u12"}', '{"a": 1,}', '{,}', '{"a"}', '{"a":}', '{} {}',
    '{"a": "\x01"}', '{"a": [1 2]}', "{'a': 1}", '{"a": 1', '{"a": -}',
    '{}', '{"a": -0}', '{"a": 0.5e+3}', '{"a": 1E-2}', '{"a": "\\u00e9\\n\\"\\\\\\/"}', ' { "a" : [ ] , "b" : { } } ',
    '{"a": [true, false, null, -1.5, "x"]}',
])
def test_the_json_check_on_edge_cases(lua: Any, text: str) -> None:
    chunk = f'{{"choices": [], "v": {text}}}'  # inside a chunk: only the JSON check decides
    _, sets = guard(lua, [f"data: {chunk}\n\n".encode() + DONE, b""])
    assert (sets[Key.STREAM_END] == StreamEnd.DONE) == strict_object(chunk), text


@pytest.mark.parametrize("text", ['{}', '{"id": "x"}', '{"choices": {}}', '{"choices": "[]"}', '{"object": "chunk"}'])
def test_an_object_that_is_no_chunk_is_malformed(lua: Any, text: str) -> None:
    _, sets = guard(lua, [ROLE + f"data: {text}\n\n".encode() + DONE, b""])
    assert sets[Key.STREAM_END] == StreamEnd.MALFORMED, text


def test_nesting_deeper_than_64_is_refused(lua: Any) -> None:
    """A bound the guard keeps where Python has none: an engine never nests this deep."""
    for depth, ok in ((63, True), (70, False)):
        _, sets = guard(lua, [b'data: {"choices": [], "a":' + b"[" * depth + b"]" * depth + b"}\n\n" + DONE, b""])
        assert (sets[Key.STREAM_END] == StreamEnd.DONE) is ok


def test_an_answer_that_is_not_a_stream_ends_as_one(lua: Any) -> None:
    """An upstream that answers a stream request with JSON: the client, which asked for a stream,
    gets one ending with the contract's event; the body's length is Envoy's to frame."""
    headers: dict[str, str] = {}
    out, sets = guard(lua, [b'{"id": "c", "choices": []}'], content_type="application/json", headers=headers)
    assert out == interrupted(StreamEnd.MALFORMED) and sets[Key.STREAM_END] == StreamEnd.MALFORMED
    assert headers == {":status": "200", "content-type": "text/event-stream"}
    _, sets = guard(lua, [STREAM, b""], content_type="text/event-stream; charset=utf-8", headers=headers)
    assert sets[Key.STREAM_END] == StreamEnd.DONE


def test_every_chunk_names_the_route_asked_for(lua: Any) -> None:
    """A client that replays an earlier answer (Claude Code's signed thinking) compares its model with
    the one it asked for: each chunk names the route; the served model is kept for the ledger."""
    stream = token("a") + STREAM
    out, sets = guard(lua, [stream, b""], route="chat-default")
    assert out == stream.replace(b'"model":"m"', b'"model":"chat-default"') and out != stream
    assert sets[Key.UPSTREAM_MODEL] == "m"


@pytest.mark.parametrize("settle", ["als", "metered", "checked"])
def test_a_json_answer_names_the_route_asked_for(lua: Any, settle: str) -> None:
    answer = {"id": "c", "object": "chat.completion", "created": 0, "model": "served/model-8b",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": '"model": "x"', "model": "y"},
                           "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}}
    body = json.dumps(answer, indent=1).encode()  # (any spacing)
    out, _ = guard(lua, [body, b""], settle=settle, route="chat-default", content_type="application/json")
    assert json.loads(out) == {**answer, "model": "chat-default"}  # the top-level model only
    assert out == body.replace(b'"served/model-8b"', b'"chat-default"')


@pytest.mark.parametrize(("body", "status", "route"), [
    (b'{"id": "c", "choices": []}', "200", "r"),  # no model
    (b'{"model": "m", "choices": [}', "200", "r"),  # no JSON
    (b'{"model": 7, "choices": []}', "200", "r"),  # no model name
    (b'{"model": "m", "choices": []}', "200", ""),  # no route
    (b'{"error": {"message": "m", "model": "m"}}', "400", "r"),  # no answer
])
def test_what_names_no_route_passes_as_it_came(lua: Any, body: bytes, status: str, route: str) -> None:
    out, _ = guard(lua, [body, b""], settle="als", status=status, route=route, content_type="application/json")
    assert out == body
