"""Answer checks as pure functions (extproc/answer_checks.py, extproc/stream_checks.py): tables of answers
against what their requests offered, and streams cut at every event."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from extproc.answer_checks import (
    Caller,
    Check,
    CheckSpec,
    Verdict,
    call_policy,
    check_completion,
    is_completion,
    spec_for,
    summary,
)
from extproc.config.policy import CompiledPolicy
from extproc.contract import GatewayError
from extproc.stream_checks import AnswerFacts, StreamChecker
from extproc.tool_catalog import ToolFacts

CALLER = Caller("acme", "k1", "api_key", (), ("payment",), "internal", "chat-default", "read_only_chat")
CATALOG = {"search_docs": ToolFacts("search_docs", True, (), "gateway.yaml"),
           "issue_refund": ToolFacts("issue_refund", True, ("payment",), "gateway.yaml")}
SEARCH = {"type": "function", "function": {"name": "search_docs", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "pattern": "^[a-z ]+$"}}, "required": ["q"]}}}
REFUND = {"type": "function", "function": {"name": "issue_refund", "parameters": {
    "type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string"}},
    "required": ["amount", "currency"]}}}
POLICY_DIR = Path(__file__).resolve().parents[2] / "policy"


def spec(mode: str = "enforce", **body: Any) -> CheckSpec:
    made = spec_for(body, mode, CALLER, CATALOG)
    assert made is not None
    return made


def answer(*calls: tuple[str, str], content: str | None = None, finish: str = "tool_calls") -> dict[str, Any]:
    tool_calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": finish,
            "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or None}}]}


def failed(doc: Any, s: CheckSpec, policy: Any = None) -> list[str]:
    return [f.check.value for f in check_completion(doc, s, policy)]


@pytest.mark.parametrize(("calls", "expected"), [
    ([("search_docs", '{"q": "refund policy"}')], []),
    ([("update_ticket", '{"q": "x"}')], ["tool_offered"]),  # catalogued, but not offered
    ([("rm_rf", "{}")], ["tool_offered"]),  # outside the catalogue
    ([("search_docs", "not json")], ["tool_arguments_json"]),
    ([("search_docs", "[1, 2]")], ["tool_arguments_json"]),  # JSON, but not an object
    ([("search_docs", '{"query": "x"}')], ["tool_arguments_schema"]),  # missing a required property
    ([("search_docs", '{"q": 7}')], ["tool_arguments_schema"]),
    ([("search_docs", '{"q": "UPPER"}')], ["tool_arguments_schema"]),  # the schema's pattern, matched by RE2
    ([("search_docs", '{"q": "a"}'), ("rm_rf", "{}")], ["tool_offered"]),  # the second of two
])
def test_tool_calls_are_checked_against_what_the_request_offered(calls: list[tuple[str, str]],
                                                                 expected: list[str]) -> None:
    assert failed(answer(*calls), spec(tools=[SEARCH])) == expected


def test_a_failure_names_the_check_and_the_schema_never_the_content() -> None:
    (f,) = check_completion(answer(("search_docs", '{"q": "SECRET-VALUE"}')), spec(tools=[SEARCH]), None)
    assert f.check is Check.TOOL_ARGUMENTS_SCHEMA and f.where == "choices[0].message.tool_calls[0]"
    assert "SECRET" not in f.text() and "pattern" in f.text()
    err = Verdict(spec(tools=[SEARCH]), (f,)).error()
    assert err.code.value == "answer_rejected" and err.status == 502 and "SECRET" not in err.message


@pytest.mark.parametrize(("fmt", "content", "expected"), [
    ({"type": "json_object"}, '{"a": 1}', []),
    ({"type": "json_object"}, "Sure! Here it is: {}", ["format_json"]),
    ({"type": "json_object"}, "[1]", ["format_json"]),  # JSON, but not one object
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}, '{"n": 3}', []),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}, '{"n": "3"}',
     ["format_schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}, "prose", ["format_json"]),
    # strict closes objects that list their properties; not strict, an extra property passes
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}, '{"n": 1, "extra": 2}', ["format_schema"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}, '{"n": 1, "extra": 2}', []),
])
def test_structured_output_is_checked(fmt: dict[str, Any], content: str, expected: list[str]) -> None:
    assert failed(answer(content=content, finish="stop"), spec(response_format=fmt)) == expected


def test_a_request_without_tools_or_json_is_not_checked() -> None:
    assert spec_for({"messages": []}, "enforce", CALLER, CATALOG) is None
    assert spec_for({"response_format": {"type": "text"}}, "enforce", CALLER, CATALOG) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}]},
     "tools[0].function.parameters"),  # a lookbehind: RE2 cannot match it, so it is refused, not skipped
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"required": 3}}}},
     "response_format.json_schema.schema"),
    # references: only inside the schema (nothing is fetched), and only to a place that is there
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {"$ref": "https://x.invalid/s"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {"$ref": "#/$defs/none"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "t", "parameters": {"$ref": "#nowhere"}}}]},
     "tools[0].function.parameters"),
])
def test_a_schema_that_is_not_one_is_the_callers_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as e:
        spec_for(body, "enforce", CALLER, CATALOG)
    assert e.value.status == 400 and e.value.param == param


def test_a_catastrophic_pattern_cannot_hold_the_worker() -> None:
    # Python's re takes exponential time on this; RE2 is linear.
    evil = {"type": "function", "function": {"name": "search_docs", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}}}}}
    t0 = time.process_time()
    assert failed(answer(("search_docs", json.dumps({"q": "a" * 40 + "!"}))), spec(tools=[evil])) == \
        ["tool_arguments_schema"]
    assert time.process_time() - t0 < 1.0


def test_the_spec_travels_as_the_decision_wrote_it() -> None:
    s = spec("report", tools=[SEARCH, REFUND], response_format={"type": "json_object"})
    assert CheckSpec.decode(s.encode()) == s


def test_shape_and_facts() -> None:
    assert not is_completion(b"<html>".decode()) and not is_completion({}) and not is_completion({"choices": [1]})
    assert is_completion(answer(("a", "{}")))
    v = Verdict(None, broken=False)
    assert not v.rejected
    assert Verdict(spec(tools=[SEARCH]), broken=True).error().code.value == "upstream_error"


@pytest.fixture(scope="module")
def example_policy() -> CompiledPolicy:
    modules = {p.name: p.read_text() for p in POLICY_DIR.glob("*.rego")}
    data = {"tenants": {}, "tools": {}}
    return CompiledPolicy(modules, data, "test")


def test_the_example_policy_decides_a_refunds_amount(example_policy: CompiledPolicy) -> None:
    policy = call_policy(example_policy)
    assert policy is not None
    s = spec(tools=[REFUND])
    assert failed(answer(("issue_refund", '{"amount": 120, "currency": "EUR"}')), s, policy) == []
    over = check_completion(answer(("issue_refund", '{"amount": 9000, "currency": "EUR"}')), s, policy)
    assert [f.check for f in over] == [Check.TOOL_CALL_POLICY]
    assert over[0].why == "the refund is over the limit for its currency"


def test_a_policy_that_cannot_decide_refuses_the_call() -> None:
    class Broken:
        decides_calls = True

        def call_decision(self, doc: Any) -> Any:
            from extproc.config.rego_engine import PolicyEvaluationError
            raise PolicyEvaluationError("boom")
    policy = call_policy(Broken())
    assert policy is not None
    assert failed(answer(("search_docs", '{"q": "ok"}')), spec(tools=[SEARCH]), policy) == ["tool_call_policy"]


def test_no_call_policy_without_its_package() -> None:
    assert call_policy(SimpleNamespace(decides_calls=False)) is None and call_policy(None) is None


# -- streams --------------------------------------------------------------------------------------

def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-s", "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def call_delta(k: int, name: str | None = None, args: str = "") -> dict[str, Any]:
    fn: dict[str, Any] = {"arguments": args}
    if name is not None:
        fn["name"] = name
    return {"tool_calls": [{"index": k, **({"id": f"c{k}", "type": "function"} if name else {}), "function": fn}]}


def run(s: CheckSpec, objs: list[Any]) -> tuple[list[Any], Any]:
    """Feed each event; what passed (decoded), and the first failure."""
    checker = StreamChecker(s, None)
    passed: list[Any] = []
    for obj in objs:
        event = b"data: " + (b"[DONE]" if obj is None else orjson.dumps(obj)) + b"\n\n"
        out, failure = checker.feed(event, obj)
        for part in out.split(b"\n\n"):
            if part:
                data = part[6:]
                passed.append(None if data == b"[DONE]" else orjson.loads(data))
        if failure is not None and checker.hold:
            return passed, failure
    return passed, None


GOOD_STREAM = [chunk({"role": "assistant", "content": ""}),
               chunk(call_delta(0, "search_docs", '{"q": ')), chunk(call_delta(0, args='"refunds"}')),
               chunk(call_delta(1, "search_docs", '{"q": "x"}')),
               chunk({}, "tool_calls"), None]


def test_a_good_streams_calls_are_released_whole_and_in_order() -> None:
    passed, failure = run(spec(tools=[SEARCH]), GOOD_STREAM)
    assert failure is None and passed == GOOD_STREAM


def test_a_call_is_held_until_it_is_complete() -> None:
    checker = StreamChecker(spec(tools=[SEARCH]), None)
    feed = [checker.feed(b"e%d" % i, obj) for i, obj in enumerate(GOOD_STREAM)]
    assert feed[0] == (b"e0", None)  # the role chunk, before any call: at once
    assert feed[1][0] == b"" and feed[2][0] == b""  # call 0's pieces: held
    assert feed[3][0] == b"e1e2"  # call 1 began: call 0 is complete, checked and released; call 1 held
    assert feed[4][0] == b"e3e4"  # the finish: call 1 released with it


@pytest.mark.parametrize("bad", [
    [chunk(call_delta(0, "rm_rf", "{}")), chunk({}, "tool_calls"), None],
    [chunk(call_delta(0, "search_docs", '{"q": ')), chunk(call_delta(0, args="7}")), chunk({}, "tool_calls"), None],
    [chunk(call_delta(0, "search_docs", "{oops")), None],  # a stream that ends with a call open: at [DONE]
])
def test_a_failing_call_never_reaches_the_client(bad: list[Any]) -> None:
    passed, failure = run(spec(tools=[SEARCH]), bad)
    assert failure is not None
    assert not any(isinstance(p, dict) and any(c["delta"].get("tool_calls") for c in p["choices"]) for p in passed)


def test_text_flows_and_a_failing_json_answer_never_finishes() -> None:
    s = spec(response_format={"type": "json_object"})
    text = [chunk({"content": "Sure"}), chunk({"content": "!"}), chunk({}, "stop"), None]
    passed, failure = run(s, text)
    assert failure is not None and failure.check is Check.FORMAT_JSON
    assert passed == text[:2]  # the text as it came, never the finish nor [DONE]
    good = [chunk({"content": '{"a"'}), chunk({"content": ": 1}"}), chunk({}, "stop"), None]
    assert run(s, good) == (good, None)


def test_report_holds_nothing_and_records_every_failure() -> None:
    checker = StreamChecker(spec("report", tools=[SEARCH]), None)
    for i, obj in enumerate([chunk(call_delta(0, "rm_rf", "{}")), chunk(call_delta(1, "search_docs", "{")),
                             chunk({}, "tool_calls"), None]):
        assert checker.feed(b"e%d" % i, obj)[0] == b"e%d" % i
    assert summary(checker.failures) == "tool_offered,tool_arguments_json"


def test_answer_facts_keep_the_upstream_id_and_finish_reasons() -> None:
    facts = AnswerFacts()
    for obj in GOOD_STREAM:
        facts.observe(obj)
    v = facts.verdict(None)
    assert v.upstream_id == "chatcmpl-s" and v.finish == ("tool_calls",)


def test_an_upstream_id_is_kept_whole_and_plain() -> None:
    """Ids reach the ledger as the upstream wrote them (a run of digits is no phone number there), with
    anything that is not an id character dropped and the length bounded (found by CI: an answer id
    whose digits log_safe took for a phone number)."""
    from extproc.redact import plain_id
    assert plain_id("chatcmpl-34618391-f018-46b1-b71e-a00d3595eef3") == "chatcmpl-34618391-f018-46b1-b71e-a00d3595eef3"
    assert plain_id("req_011CSHoEeqs5C35K2UUqR7Fy") == "req_011CSHoEeqs5C35K2UUqR7Fy"
    assert plain_id('x"}\n<b>\u00e9 y') == "xby" and len(plain_id("a" * 500)) == 128


def test_references_inside_the_schema_are_followed() -> None:
    defs = {"$defs": {"q": {"$anchor": "Q", "type": "string"}}, "type": "object", "required": ["q"]}
    for ref in ("#/$defs/q", "#Q"):
        s = spec(tools=[{"type": "function", "function": {"name": "search_docs", "parameters": {
            **defs, "properties": {"q": {"$ref": ref}}}}}])
        assert failed(answer(("search_docs", '{"q": "ok"}')), s) == []
        assert failed(answer(("search_docs", '{"q": 7}')), s) == ["tool_arguments_schema"]


# -- truncation at the token limit ------------------------------------------------------------------

def test_a_call_or_json_cut_at_the_token_limit_is_answered_as_the_truncation_it_is() -> None:
    """`length`: the caller's limit (or the route's cap) left the JSON unfinished, not the model. The
    answer passes with that finish reason, as every provider answers it; the same JSON unfinished at any
    other finish is the model's fault and refused."""
    tools, fmt = spec(tools=[SEARCH]), spec(response_format={"type": "json_object"})
    assert failed(answer(("search_docs", '{"q": "ref'), finish="length"), tools) == []
    assert failed(answer(("search_docs", '{"q": "ref'), finish="tool_calls"), tools) == ["tool_arguments_json"]
    assert failed(answer(content='{"a": ', finish="length"), fmt) == []
    assert failed(answer(content='{"a": ', finish="stop"), fmt) == ["format_json"]
    # What a token limit cannot excuse: a tool nobody offered, arguments whole but against the schema.
    assert failed(answer(("rm_rf", '{"x'), finish="length"), tools) == ["tool_offered"]
    assert failed(answer(("search_docs", '{"q": 7}'), finish="length"), tools) == ["tool_arguments_schema"]


def stopped(doc: dict[str, Any], stop_reason: Any) -> dict[str, Any]:
    """The answer ended by a stop sequence: vLLM (and the answer filters) name the one that matched."""
    for choice in doc["choices"]:
        choice["stop_reason"] = stop_reason
    return doc


def test_a_call_or_json_cut_at_the_callers_stop_sequence_is_the_truncation_it_asked_for() -> None:
    """`stop` with the stop sequence (or token) that matched: the caller's sequence ended the JSON. A
    natural end (`stop`, no stop_reason) with the JSON unfinished is still the model's fault."""
    tools, fmt = spec(tools=[SEARCH]), spec(response_format={"type": "json_object"})
    assert failed(stopped(answer(content='{"a"', finish="stop"), ":"), fmt) == []
    assert failed(stopped(answer(content='{"a"', finish="stop"), 128009), fmt) == []  # a stop token's id
    assert failed(stopped(answer(("search_docs", '{"q'), finish="stop"), "END"), tools) == []
    for natural in (None, "", True):
        assert failed(stopped(answer(content='{"a"', finish="stop"), natural), fmt) == ["format_json"]
    assert failed(stopped(answer(("rm_rf", '{"x'), finish="stop"), "END"), tools) == ["tool_offered"]
    cut_text = [chunk({"content": '{"a"'}), {**chunk({}, "stop"), "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": ":"}]}, None]
    assert run(fmt, cut_text) == (cut_text, None)
    _, failure = run(fmt, [cut_text[0], chunk({}, "stop"), None])
    assert failure is not None and failure.check is Check.FORMAT_JSON


def test_a_stream_cut_at_the_token_limit_releases_the_partial_call_and_its_finish() -> None:
    cut_call = [chunk({"role": "assistant", "content": ""}), chunk(call_delta(0, "search_docs", '{"q": "re')),
                chunk({}, "length"), None]
    assert run(spec(tools=[SEARCH]), cut_call) == (cut_call, None)
    cut_text = [chunk({"content": '{"a": '}), chunk({}, "length"), None]
    assert run(spec(response_format={"type": "json_object"}), cut_text) == (cut_text, None)
    _, failure = run(spec(tools=[SEARCH]), [*cut_call[:2], chunk({}, "tool_calls"), None])
    assert failure is not None and failure.check is Check.TOOL_ARGUMENTS_JSON
