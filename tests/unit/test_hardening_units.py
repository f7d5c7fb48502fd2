"""The pure parts of the hardening (issue 11): lenient parsing of Envoy's messages, header and body
validation, the upstream header allow-list's pattern, log-safe text, sealed replays, what failures
are charged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import re2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from extproc import chat, headers
from extproc.config import load_snapshot
from extproc.config.policy import Decision
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.redact import log_safe
from extproc.replay import Answer, NotReplayable, Sealer
from extproc.stages.redact import Redaction
from extproc.wire import lenient_parser
from llmgw.render.bootstrap import FORWARDED_HEADERS, names_outside
from tests.conftest import POLICY

SNAP = load_snapshot(POLICY)


# -- lenient parsing -------------------------------------------------------------------------------

def _with_attribute(value: str) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest()
    req.request_body.body = b"{}"
    req.attributes["envoy.filters.http.ext_proc"].update({"request.headers['authorization']": value,
                                                           "request.id": "rid-1"})
    return req


@given(st.binary(min_size=1, max_size=40).filter(lambda b: not _is_utf8(b)), st.integers(0, 20))
@settings(max_examples=200, deadline=None)
def test_a_string_that_is_not_utf8_is_scrubbed_not_fatal(bad: bytes, pad: int) -> None:
    placeholder = "P" * len(bad)
    wire = _with_attribute("x" * pad + placeholder).SerializeToString()
    assume(wire.count(b"x" * pad + placeholder.encode()) == 1)  # never a length byte that reads as "P"
    corrupt = wire.replace(b"x" * pad + placeholder.encode(), b"x" * pad + bad)  # same length: framing holds
    with pytest.raises(DecodeError):
        ep.ProcessingRequest.FromString(corrupt)  # what gRPC's own parser does
    msg = lenient_parser(ep.ProcessingRequest)(corrupt)
    attrs = msg.attributes["envoy.filters.http.ext_proc"].fields
    assert attrs["request.headers['authorization']"].string_value == "x" * pad + bad.decode("utf-8", "replace")
    assert attrs["request.id"].string_value == "rid-1" and msg.request_body.body == b"{}"


def test_a_message_that_parses_is_untouched() -> None:
    wire = _with_attribute("Bearer k").SerializeToString()
    assert lenient_parser(ep.ProcessingRequest)(wire) == ep.ProcessingRequest.FromString(wire)


def test_garbage_still_fails_the_call() -> None:
    with pytest.raises(DecodeError):
        lenient_parser(ep.ProcessingRequest)(b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- headers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "ok"), [("1", True), ("86400000", True), ("0", False), ("²", False),
                                           ("١٢", False), ("1 ", False), ("86400001", False), ("1\ufffd0", False)])
def test_deadline_is_ascii_digits(value: str, ok: bool) -> None:
    if ok:
        assert headers.deadline_ms(value) == int(value)
    else:
        with pytest.raises(GatewayError) as e:
            headers.deadline_ms(value)
        assert e.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(("value", "ok"), [("k-1", True), ("a" * 255, True), ("", False), ("a" * 256, False),
                                           ("k\ufffd", False), ("k 1", False), ("ключ", False)])
def test_idempotency_key_is_visible_ascii(value: str, ok: bool) -> None:
    if ok:
        assert headers.idempotency_key(value) == value
    else:
        with pytest.raises(GatewayError):
            headers.idempotency_key(value)


def test_trace_context_is_continued_only_when_valid() -> None:
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert headers.trace_context(tp, "a=1") == (tp, "a=1")
    assert headers.trace_context(tp, "\ufffd") == (tp, "")
    assert headers.trace_context("00-" + "0" * 32 + "-00f067aa0ba902b7-01", "a=1") == ("", "")
    assert headers.trace_context("garbage", "a=1") == ("", "")


# -- the upstream header allow-list ----------------------------------------------------------------

_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-:_", min_size=1, max_size=24)


@given(st.one_of(_NAME, st.sampled_from([*FORWARDED_HEADERS, *(h[:-1] for h in FORWARDED_HEADERS),
                                         *(h + "x" for h in FORWARDED_HEADERS), ":path", ":authority"])))
@settings(max_examples=500, deadline=None)
def test_the_strip_pattern_matches_every_name_but_the_allowed(name: str) -> None:
    pattern = re2.compile(names_outside(FORWARDED_HEADERS))
    assert bool(pattern.search(name)) == (name not in FORWARDED_HEADERS and not name.startswith(":"))


# -- the chat request ------------------------------------------------------------------------------

def _validate(body: dict[str, Any]) -> dict[str, Any]:
    return chat.validate(body, max_messages=64, max_n=8)


def test_an_sdk_shaped_conversation_is_accepted() -> None:
    """What the openai SDK sends back when an earlier answer is appended to the conversation."""
    answer = {"role": "assistant", "content": "hi", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "reasoning": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, answer,
                                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.2, "seed": 7, "n": 2, "user": "u"}
    assert _validate(body) is body


@pytest.mark.parametrize(("body", "code", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": []}, "unsupported_field",
     "functions"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -100}, "unsupported_field",
     "priority"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "weight": 1}]}, "unsupported_field",
     "messages[0].weight"),
    ({"model": "m", "messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "unsupported_field",
     "messages[0].audio"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
        "name": "a b"}}]}, "invalid_request", "tools[0].function.name"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "invalid_request",
     "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "invalid_request",
     "temperature"),
    ({"model": "m", "messages": [{"role": "user"}]}, "invalid_request", "messages[0].content"),
    ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "invalid_request", "messages[0].tool_call_id"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "invalid_request",
     "messages[0].tool_calls"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
     "invalid_request", "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": json.loads('{"a":' * 40 + "1" + "}" * 40)}}},
     "invalid_request", "response_format.json_schema.schema"),
])
def test_what_the_gateway_refuses_names_the_field(body: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(GatewayError) as e:
        _validate(body)
    assert (e.value.code.value, e.value.param) == (code, param)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=40))
@settings(max_examples=300, deadline=None)
def test_validation_only_raises_contract_errors(doc: Any) -> None:
    for body in (doc, {"model": "m", "messages": doc}, {"model": "m", "messages": [doc]},
                 {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": doc}):
        try:
            _validate(body)  # type: ignore[arg-type]
        except GatewayError as e:
            assert e.code in (ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_FIELD)


def test_prompt_bytes_count_every_rendered_field() -> None:
    base = {"messages": [{"role": "user", "content": "x"}]}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"q": "é"}'}}
    longer = {"messages": [{"role": "user", "content": "x", "name": "n" * 10},
                           {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "r" * 7}]}
    assert chat.prompt_bytes(longer) >= chat.prompt_bytes(base) + 10 + 7 + len(json.dumps([call]))
    # The longest rendering of a tool's JSON: Jinja's tojson escapes é to 6 bytes.
    assert chat.prompt_bytes({"messages": [], "tools": [{"d": "é"}]}) == len('[{"d": "\\u00e9"}]')


def test_a_tool_name_holding_redacted_data_is_refused() -> None:
    ex = Exchange(snapshot=SNAP, decision=Decision(True, (), ("payment_card",), False, "r"))
    ex.body = {"model": "m", "messages": [{"role": "user", "content": "x"}],
               "tools": [{"type": "function", "function": {"name": "4111111111111111"}}]}
    with pytest.raises(GatewayError) as e:
        asyncio.run(Redaction().run(ex))
    assert (e.value.code, e.value.param) == (ErrorCode.INVALID_REQUEST, "tools[0].function.name")


# -- log-safe text and sealed replays --------------------------------------------------------------

def test_log_safe_redacts_escapes_and_bounds() -> None:
    assert log_safe("tool bob@example.com denied") == "tool [EMAIL_1] denied"
    assert log_safe("a\u202eb\x00\n") == "a\\u202eb\\u0000\\u000a"
    assert len(log_safe("x" * 1000)) == 160 and log_safe("x" * 1000).endswith("...")


def test_sealed_answers_open_only_with_their_key_and_record() -> None:
    sealer = Sealer("secret-1")
    answer = Answer(200, "text/event-stream", b"data: {\"x\": 1}\n\n")
    kept = sealer.seal("llmgw:{acme}:idem:abc", answer, 1 << 20)
    assert kept.startswith("v1:") and b"data" not in kept.encode()
    assert sealer.open("llmgw:{acme}:idem:abc", kept) == answer
    for other, record in ((Sealer("secret-2"), "llmgw:{acme}:idem:abc"), (sealer, "llmgw:{other}:idem:abc")):
        with pytest.raises(NotReplayable) as e:
            other.open(record, kept)
        assert e.value.code is ErrorCode.IDEMPOTENCY_CONFLICT
    tampered = kept[:-4] + ("AAAA" if not kept.endswith("AAAA") else "BBBB")
    with pytest.raises(NotReplayable):
        sealer.open("llmgw:{acme}:idem:abc", tampered)


def test_without_a_key_or_over_the_limit_only_a_refusal_is_kept() -> None:
    digest = Sealer(None).seal("k", Answer(200, "application/json", b"{}"), 1 << 20)
    assert digest.startswith("d1:") and "{}" not in digest
    too_big = Sealer("s").seal("k", Answer(200, "application/json", b"x" * 11), 10)
    for kept in (digest, too_big):
        with pytest.raises(NotReplayable):
            Sealer("s").open("k", kept)


def test_a_final_status_envoy_no_longer_waits_for_is_one_line_not_a_traceback() -> None:
    """gRPC logs a stream's final status it could not send (Envoy had closed the stream) with a
    traceback; the fuzz test once found it in the worker's log. It becomes one INFO line; any other
    error keeps its traceback."""
    import logging

    from extproc.server import _peer_gone

    class ExecuteBatchError(Exception):
        pass

    def record(error: BaseException) -> logging.LogRecord:
        return logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1, "raised in core", (),
                                 (type(error), error, None))

    gone = record(ExecuteBatchError('Failed "execute_batch": (<...SendStatusFromServerOperation ...>,)'))
    assert _peer_gone(gone) and gone.levelno == logging.INFO and gone.exc_info is None
    other = record(ValueError("a real error"))
    assert _peer_gone(other) and other.levelno == logging.ERROR and other.exc_info is not None
