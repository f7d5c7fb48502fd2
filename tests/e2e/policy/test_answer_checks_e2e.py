"""Answers checked after generation, through the real Envoy: a model (the simulator, on the operator's
fault) that calls a tool the request never offered, one outside the catalogue, with arguments that are
not JSON or miss a required property, over the policy's refund limit, or answers prose where JSON
(or a schema) was asked for - each refused with the contract's 502 `answer_rejected` (a JSON answer)
or ended with `stream_interrupted` before the client can assemble the call (a stream), on the pool
and on a route translated to another API shape; passed and named on a `report` route; recorded in the
ledger and the metrics; charged as the work the upstream did."""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import assert_contract_error, inject_fault, request, stream_raw
from tests.promtext import scrape, value

pytestmark = pytest.mark.e2e

KEY = DEMO_KEYS["acme"]
PAYER_KEY = "sk-test-payer-0123456789"  # acme, granted the payment effect
SEARCH = {"type": "function", "function": {"name": "search_docs", "description": "search the docs", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
REFUND = {"type": "function", "function": {"name": "issue_refund", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"},
                                     "currency": {"type": "string", "enum": ["EUR", "USD"]}},
    "required": ["order_id", "amount", "currency"]}}}
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "count", "strict": True, "schema": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}


def quoted(text: str) -> str:
    return urllib.parse.quote(text, safe="")


def checks_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    demo = yaml.safe_load((dst / "keys.yaml").read_text())["keys"]
    (dst / "keys.yaml").write_text(yaml.safe_dump({"keys": [*demo, {
        "id": "acme-payer", "tenant": "acme", "sha256": hashlib.sha256(PAYER_KEY.encode()).hexdigest(),
        "effects": ["payment"]}]}))
    for name, mode in (("chat-default", "report"), ("chat-anthropic", "report")):
        route = yaml.safe_load((dst / f"routes/{name}.yaml").read_text())
        route.update(route_contract=f"{name}-report", answer_checks=mode)
        (dst / f"routes/{name}-report.yaml").write_text(yaml.safe_dump(route))
    return dst


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("answer-checks")
    s = start_stack(tmp / "state", checks_policy(tmp), simulate_providers=True)
    yield s
    s.stop()


def upstreams(gw: Stack, route: str) -> list[str]:
    for shape in ("anthropic", "gemini", "bedrock"):  # the demo providers' routes
        if route.startswith(f"chat-{shape}"):
            return [f"http://{h}:{p}" for h, p in gw.render.providers[f"demo-{shape}"]]
    return gw.engine_urls("engine-pool")


def ask(gw: Stack, route: str, fault: str, tools: list[Any] | None = None, key: str = KEY,
        **extra: Any) -> tuple[str, dict[str, Any]]:
    """(marker, body) of a request whose upstream answers with `fault` ("" for none)."""
    marker = inject_fault(upstreams(gw, route), fault) if fault else "plain"
    body = {"model": route, "max_tokens": 64, "messages": [{"role": "user", "content": f"{marker}: use search_docs"}],
            **({"tools": tools} if tools is not None else {}), **extra}
    return marker, body


def post(gw: Stack, body: dict[str, Any], key: str = KEY) -> Any:
    return request(f"{gw.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {key}"})


BAD_CALLS = [
    ("tool_name=update_ticket", "tool_offered"),  # in the catalogue, never offered by this request
    ("tool_name=rm_rf", "tool_offered"),  # outside the catalogue
    (f"tool_args={quoted('not json')}", "tool_arguments_json"),
    (f"tool_args={quoted(json.dumps({'query': 'x'}))}", "tool_arguments_schema"),
]


@pytest.mark.parametrize(("fault", "check"), BAD_CALLS)
def test_a_bad_tool_call_in_a_json_answer_is_refused(gw: Stack, fault: str, check: str) -> None:
    _, body = ask(gw, "chat-default", fault, [SEARCH])
    r = post(gw, body)
    err = assert_contract_error(r, 502, "answer_rejected")
    assert check in err["message"] and "query" not in err["message"]
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "answer_rejected" and entry["status"] == 502
    assert entry["answer_checks"]["rejected"] and [f["check"] for f in entry["answer_checks"]["failed"]] == [check]
    (attempt,) = entry["attempts"]
    # The engine answered (200) and did the work: charged at its reported usage.
    assert attempt["status"] == 200 and attempt["finish_reason"] == "tool_calls" and attempt["upstream_id"]
    assert entry["settlement"] == "actual" and entry["usage"]["completion_tokens"] > 0


def test_a_good_call_passes_and_the_ledger_says_it_was_checked(gw: Stack) -> None:
    _, body = ask(gw, "chat-default", "", [SEARCH])
    r = post(gw, body)
    assert r.status == 200, r.body
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "search_docs" and "q" in json.loads(call["function"]["arguments"])
    assert "x-llmgw-answer-checks" not in r.headers
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "complete" and entry["answer_checks"]["failed"] == []
    assert set(entry["answer_checks"]["run"]) >= {"tool_offered", "tool_arguments_schema", "tool_call_policy"}
    assert entry["attempts"][0]["upstream_id"] == r.json()["id"]


def events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:]
                out.append(None if data == b"[DONE]" else json.loads(data))
    return out


def streamed(gw: Stack, body: dict[str, Any], key: str = KEY) -> tuple[str, bytes]:
    """(request id, every byte) of a checked stream: its headers were a 200 before any check could run."""
    status, rid, raw = stream_raw(f"{gw.url}/v1/chat/completions", body, {"authorization": f"Bearer {key}"})
    assert status == 200, raw[:300]
    return rid, raw


def has_call(evs: list[Any]) -> bool:
    return any(isinstance(e, dict) and any((c.get("delta") or {}).get("tool_calls") for c in e.get("choices") or ())
               for e in evs)


@pytest.mark.parametrize(("fault", "check"), BAD_CALLS)
def test_a_bad_tool_call_in_a_stream_never_reaches_the_client(gw: Stack, fault: str, check: str) -> None:
    _, body = ask(gw, "chat-default", fault, [SEARCH], stream=True)
    rid, raw = streamed(gw, body)
    evs = events(raw)
    assert not has_call(evs), raw[-800:]
    assert evs[-1]["error"]["code"] == "stream_interrupted" and check in evs[-1]["error"]["message"]
    assert None not in evs  # no [DONE]
    entry = ledger_of(gw, rid, "acme")
    assert entry["termination"] == "answer_rejected" and entry["answer_checks"]["failed"][0]["check"] == check
    assert entry["usage"]["completion_tokens"] > 0  # read to its end: charged as generated


def test_a_good_stream_passes_its_calls_whole(gw: Stack) -> None:
    _, body = ask(gw, "chat-default", "", [SEARCH], stream=True)
    rid, raw = streamed(gw, body)
    evs = events(raw)
    assert has_call(evs) and evs[-1] is None
    args = "".join(tc["function"].get("arguments", "") for e in evs if isinstance(e, dict)
                   for c in e["choices"] for tc in (c["delta"].get("tool_calls") or ()))
    assert "q" in json.loads(args)
    entry = ledger_of(gw, rid, "acme")
    assert entry["termination"] == "complete" and entry["attempts"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_the_policy_decides_a_returned_calls_effect(gw: Stack, stream: bool) -> None:
    """A refund the caller may offer (it holds the payment effect) is still refused over the limit."""
    over = quoted(json.dumps({"order_id": "A-1", "amount": 9000, "currency": "EUR"}))
    _, body = ask(gw, "chat-default", f"tool_name=issue_refund,tool_args={over}", [REFUND], stream=stream)
    if stream:
        rid, raw = streamed(gw, body, PAYER_KEY)
        evs = events(raw)
        assert not has_call(evs) and "tool_call_policy" in evs[-1]["error"]["message"]
    else:
        r = post(gw, body, PAYER_KEY)
        assert "tool_call_policy" in assert_contract_error(r, 502, "answer_rejected")["message"]
        rid = r.headers["x-request-id"]
    failed = ledger_of(gw, rid, "acme")["answer_checks"]["failed"]
    assert failed == [{"check": "tool_call_policy", "where": "choices[0].message.tool_calls[0]",
                       "why": "the refund is over the limit for its currency"}]
    within = quoted(json.dumps({"order_id": "A-1", "amount": 120, "currency": "EUR"}))
    _, body = ask(gw, "chat-default", f"tool_name=issue_refund,tool_args={within}", [REFUND])
    r = post(gw, body, PAYER_KEY)
    assert r.status == 200 and r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "issue_refund"


@pytest.mark.parametrize(("fmt", "content", "check"), [
    ({"type": "json_object"}, "Sure! Here is your JSON.", "format_json"),
    (ANSWER_SCHEMA, json.dumps({"n": "three"}), "format_schema"),
    (ANSWER_SCHEMA, json.dumps({"n": 3, "extra": True}), "format_schema"),  # strict: no other properties
])
@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_outside_what_was_asked_is_refused(gw: Stack, fmt: dict[str, Any], content: str,
                                                             check: str, stream: bool) -> None:
    _, body = ask(gw, "chat-default", f"content={quoted(content)}", response_format=fmt, stream=stream)
    if stream:
        evs = events(streamed(gw, body)[1])
        # The text flowed as it came; the answer never finished normally.
        assert evs[-1]["error"]["code"] == "stream_interrupted" and check in evs[-1]["error"]["message"]
        assert not any(isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices") or ())
                       for e in evs)
    else:
        assert check in assert_contract_error(post(gw, body), 502, "answer_rejected")["message"]
    _, good = ask(gw, "chat-default", "", response_format=fmt)
    r = post(gw, good)
    assert r.status == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_a_report_route_passes_the_answer_and_names_the_failed_check(gw: Stack) -> None:
    _, body = ask(gw, "chat-default-report", "tool_name=rm_rf", [SEARCH])
    r = post(gw, body)
    assert r.status == 200 and r.headers["x-llmgw-answer-checks"] == "tool_offered"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "complete" and not entry["answer_checks"]["rejected"]
    assert entry["answer_checks"]["mode"] == "report" and entry["answer_checks"]["failed"][0]["check"] == "tool_offered"
    _, body = ask(gw, "chat-default-report", "tool_name=rm_rf", [SEARCH], stream=True)
    rid, raw = streamed(gw, body)
    assert has_call(events(raw)) and events(raw)[-1] is None
    assert ledger_of(gw, rid, "acme")["answer_checks"]["failed"][0]["check"] == "tool_offered"
    samples = scrape(gw.metrics_url.removesuffix("/metrics"))
    assert value(samples, "llmgw_answer_check_failures_total", route="chat-default-report", check="tool_offered",
                 action="passed") >= 2
    assert value(samples, "llmgw_answer_check_failures_total", route="chat-default", action="refused") >= 1
    assert value(samples, "llmgw_finish_reasons_total", route="chat-default-report", finish_reason="tool_calls") >= 2


@pytest.mark.parametrize("route", ["chat-anthropic", "chat-gemini", "chat-bedrock"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_translated_providers_bad_call_is_refused(gw: Stack, stream: bool, route: str) -> None:
    """The same checks on each provider shape's answer, after Envoy translated it."""
    _, body = ask(gw, route, "tool_name=update_ticket", [SEARCH], stream=stream)
    if stream:
        rid, raw = streamed(gw, body)
        evs = events(raw)
        assert not has_call(evs) and "tool_offered" in evs[-1]["error"]["message"]
    else:
        r = post(gw, body)
        assert "tool_offered" in assert_contract_error(r, 502, "answer_rejected")["message"]
        rid = r.headers["x-request-id"]
    entry = ledger_of(gw, rid, "acme")
    assert entry["termination"] == "answer_rejected"
    assert entry["attempts"][-1]["deployment"] == "demo-" + route.removeprefix("chat-")
    _, good = ask(gw, route, "", [SEARCH])
    assert post(gw, good).status == 200


def test_a_door_caller_gets_the_refusal_in_its_own_shape(gw: Stack) -> None:
    """The Anthropic SDK, as its users write it: the refusal is an Anthropic error whose type is the
    SDK's for a 502; nothing of the call reaches it."""
    marker = inject_fault(upstreams(gw, "chat-default"), "tool_name=rm_rf")
    c = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as e:
        c.messages.create(model="chat-default", max_tokens=64, messages=[{"role": "user", "content": marker}],
                          tools=[{"name": "search_docs", "input_schema": SEARCH["function"]["parameters"]}])
    assert e.value.status_code == 502 and "answer_rejected" in str(e.value.body)


def test_the_openai_sdk_gets_the_refusal(gw: Stack) -> None:
    marker = inject_fault(upstreams(gw, "chat-default"), f"tool_args={quoted('not json')}")
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="chat-default", messages=[{"role": "user", "content": marker}],
                                  tools=[SEARCH])  # type: ignore[list-item]
    assert e.value.code == "answer_rejected"


@pytest.mark.parametrize("tools", [None, [SEARCH]])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engines_html_page_is_not_an_answer(gw: Stack, stream: bool, tools: list[Any] | None) -> None:
    """An upstream 200 that is not a chat completion (a proxy's HTML page), checked request or not: 502
    upstream_error before any byte of it, charged as the work it may have been, never passed as a 200."""
    _, body = ask(gw, "chat-default", "html", tools, stream=stream)
    r = post(gw, body)
    assert "not a chat completion" in assert_contract_error(r, 502, "upstream_error")["message"]
    assert b"<html" not in r.body
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "upstream_error" and entry["attempts"][-1]["status"] == 200, entry
    # A JSON answer may have been generated whole (the whole reservation); a stream's first byte was its
    # first token, so only the prompt's bound.
    assert entry["settlement"] == ("partial" if stream else "ambiguous"), entry


def test_an_html_page_reaches_a_door_caller_in_its_shape(gw: Stack) -> None:
    marker = inject_fault(upstreams(gw, "chat-default"), "html")
    c = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as e:
        c.messages.create(model="chat-default", max_tokens=64, messages=[{"role": "user", "content": marker}])
    assert "upstream_error" in str(e.value.body) and "<html" not in str(e.value.body)


@pytest.mark.parametrize("tools", [None, [SEARCH]])
def test_a_stream_event_that_is_no_chunk_ends_the_stream(gw: Stack, tools: list[Any] | None) -> None:
    """Valid JSON that is not a chunk, mid-stream: the Lua guard (a plain stream) and ext_proc's guard (a
    checked one) both end the stream there with stream_interrupted; nothing of it reaches the client."""
    _, body = ask(gw, "chat-default", "stray_after=2", tools, stream=True)
    rid, raw = streamed(gw, body)
    evs = events(raw)
    assert b"stray" not in raw and evs[-1]["error"]["code"] == "stream_interrupted", raw[-400:]
    assert "malformed" in evs[-1]["error"]["message"]
    assert ledger_of(gw, rid, "acme")["termination"] == "stream_interrupted"


@pytest.mark.parametrize("stream", [False, True])
def test_every_answer_names_the_upstreams_id_and_finish(gw: Stack, stream: bool) -> None:
    """Unchecked answers too (the access log settles them): the attempt's record keeps the upstream's own
    id for its answer, and its finish reason (a stream's from the Lua guard, a JSON answer's from the Lua
    answer filter, which reads every pool JSON answer)."""
    _, body = ask(gw, "chat-default", "", None, stream=stream, **({"stream_options": {"include_usage": True}}
                                                                   if stream else {}))
    if stream:
        rid, raw = streamed(gw, body)
        evs = [e for e in events(raw) if isinstance(e, dict)]
        upstream_id, finish = evs[0]["id"], next(c["finish_reason"] for e in evs for c in e["choices"]
                                                 if c.get("finish_reason"))
    else:
        r = post(gw, body)
        rid, upstream_id, finish = r.headers["x-request-id"], r.json()["id"], r.json()["choices"][0]["finish_reason"]
    (attempt,) = ledger_of(gw, rid, "acme")["attempts"]
    assert attempt["upstream_id"] == upstream_id and attempt["status"] == 200
    assert attempt.get("finish_reason") == finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_translated_answer_keeps_its_providers_finish_reason(gw: Stack, stream: bool) -> None:
    """An Anthropic-shaped provider's `end_turn` beside the internal `stop`, and its own request id
    (`request-id`), in the attempt's record."""
    _, body = ask(gw, "chat-anthropic", "", None, stream=stream)
    rid = streamed(gw, body)[0] if stream else post(gw, body).headers["x-request-id"]
    (attempt,) = ledger_of(gw, rid, "acme")["attempts"]
    assert (attempt["finish_reason"], attempt["native_finish_reason"]) in (("stop", "end_turn"),
                                                                           ("length", "max_tokens"))
    assert attempt["upstream_request_id"].startswith("req_")


def test_a_pool_json_answer_that_is_no_completion_is_refused(gw: Stack) -> None:
    """JSON, with a JSON content type, but no chat completion (garbage=7: random bytes; the simulator
    labels them application/json), on a request that asked for no checks: the Lua answer filter reads
    every pool JSON answer as the OpenAI shape, and this one is the contract's 502, charged as the work
    it may have been."""
    _, body = ask(gw, "chat-default", "garbage=7", None)
    r = post(gw, body)
    assert_contract_error(r, 502, "upstream_error")
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["settlement"] == "ambiguous" and entry["attempts"][-1]["status"] == 200
    _, body = ask(gw, "chat-default", "", None)
    r = post(gw, body)
    assert r.status == 200
    assert ledger_of(gw, r.headers["x-request-id"], "acme")["attempts"][-1]["finish_reason"] in ("stop", "length")


def test_a_door_caller_gets_a_pool_answer_that_is_none_in_its_shape(gw: Stack) -> None:
    marker = inject_fault(upstreams(gw, "chat-default"), "garbage=7")
    c = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as e:
        c.messages.create(model="chat-default", max_tokens=64, messages=[{"role": "user", "content": marker}])
    assert "upstream_error" in str(e.value.body)


def test_a_gemini_caller_gets_the_refusal_in_its_shape(gw: Stack) -> None:
    """google-genai, as its users write it: a call of a tool the request never declared is the SDK's
    server error, with the contract's code inside the Gemini-shaped error."""
    from google import genai
    from google.genai import errors, types

    marker = inject_fault(upstreams(gw, "chat-default"), "tool_name=rm_rf")
    c = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=gw.url))
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(
        name="search_docs", parameters_json_schema=SEARCH["function"]["parameters"])])
    with pytest.raises(errors.ServerError) as e:
        c.models.generate_content(model="chat-default", contents=marker,
                                  config=types.GenerateContentConfig(tools=[tool]))
    assert e.value.code == 502 and "answer_rejected" in str(e.value)


@pytest.mark.parametrize("parameters", [
    {"type": "objekt"},  # not a JSON Schema
    {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?<=x)y"}}},  # RE2 cannot match it
    {"type": "object", "properties": {"q": {"type": "string", "pattern": "(unclosed"}}},
    {"type": "object", "$ref": "https://example.invalid/schema.json"},  # nothing is fetched
    {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},  # a pointer to nowhere
    {"type": "object", "required": 7},
    "not an object",
])
def test_a_hostile_tool_schema_is_the_callers_400(gw: Stack, parameters: Any) -> None:
    """Schemas are the caller's input: through the real Envoy, one that is no schema (or that the gateway
    could only match by backtracking, or would have to fetch) is a 400 in the contract's shape, never a
    5xx at answer time (found by this test: a reference that resolved nowhere passed intake, then made
    the answer's check raise)."""
    tools = [{"type": "function", "function": {"name": "search_docs", "parameters": parameters}}]
    _, body = ask(gw, "chat-default", "", tools)
    err = assert_contract_error(post(gw, body), 400, "invalid_request")
    assert err["param"] == "tools[0].function.parameters", err


def test_a_call_cut_at_the_callers_max_tokens_is_answered_as_each_provider_answers_it(gw: Stack) -> None:
    """max_tokens 4 with a tool to call: the engine's call is cut in its arguments. That is the caller's
    limit, not the model's fault: 200 with the partial call and the truncation's finish reason in each
    SDK's own words (`length`, `max_tokens`, `MAX_TOKENS`), never a 502 an SDK would retry and pay for."""
    from google import genai
    from google.genai import types

    ask_ = [{"role": "user", "content": "cut: use search_docs to look up the refund policy"}]
    oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    done = oa.chat.completions.create(model="chat-default", max_tokens=4, messages=ask_, tools=[SEARCH],
                                      tool_choice="required")  # type: ignore[arg-type,list-item]
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls, choice
    args = choice.message.tool_calls[0].function.arguments  # type: ignore[union-attr]
    with pytest.raises(json.JSONDecodeError):
        json.loads(args)  # partial, as the engine wrote it
    chunks = list(oa.chat.completions.create(model="chat-default", max_tokens=4, messages=ask_, tools=[SEARCH],
                                             tool_choice="required", stream=True))  # type: ignore[arg-type,list-item]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    an = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    msg = an.messages.create(model="chat-default", max_tokens=4, messages=ask_,  # type: ignore[arg-type]
                             tools=[{"name": "search_docs", "input_schema": SEARCH["function"]["parameters"]}],
                             tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens", msg
    ge = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=gw.url))
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(
        name="search_docs", parameters_json_schema=SEARCH["function"]["parameters"])])
    answer = ge.models.generate_content(model="chat-default", contents=ask_[0]["content"],
                                        config=types.GenerateContentConfig(tools=[tool], max_output_tokens=4,
        tool_config=types.ToolConfig(function_calling_config=types.FunctionCallingConfig(mode="ANY"))))
    assert answer.candidates and answer.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS, answer


def test_json_cut_at_the_callers_stop_sequence_is_answered_as_the_stop_it_asked_for(gw: Stack) -> None:
    """A stop sequence the JSON holds (`:`) ends it after its first key: the caller's own stop, answered
    200 with the text so far and each SDK's stop (`stop`; `stop_sequence` naming the sequence) - not a
    502 `answer_rejected`, which the SDKs would send again and pay for."""
    ask_ = [{"role": "user", "content": "a city as JSON"}]
    oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    done = oa.chat.completions.create(model="chat-default", max_tokens=40, messages=ask_,  # type: ignore[arg-type]
                                      response_format={"type": "json_object"}, stop=[":"])
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content, choice
    assert ":" not in choice.message.content and choice.message.content.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)  # cut, as the caller asked
    chunks = list(oa.chat.completions.create(model="chat-default", max_tokens=40, messages=ask_,  # type: ignore[arg-type]
                                             response_format={"type": "json_object"}, stop=[":"], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    an = anthropic.Anthropic(base_url=gw.url, api_key=KEY, max_retries=0)
    msg = an.messages.create(model="chat-default", max_tokens=40, messages=ask_, stop_sequences=[":"],  # type: ignore[arg-type]
                             extra_body={"output_config": {"format": {"type": "json_schema", "schema": {
                                 "type": "object", "properties": {"answer": {"type": "string"}},
                                 "required": ["answer"]}}}})
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", ":"), msg
    # Without the stop, the same request's JSON is whole: the cut was the caller's sequence.
    whole = oa.chat.completions.create(model="chat-default", max_tokens=40, messages=ask_,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    assert json.loads(whole.choices[0].message.content or "") and whole.choices[0].finish_reason == "stop"
