"""The Lua filter nearest the router (extproc/lua/upstream_status.lua, as the renderer renders it), run
under LuaJIT with a stand-in for Envoy's handle: the upstream's own status and request id recorded, and
an upstream's refusal's reason carried into the contract's error, secrets redacted. Through real Envoy,
each front door's caller reads it in tests/e2e/doors/test_upstream_refusal_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.contract import ErrorCode
from extproc.names import Header, Key
from extproc.redact import Redactor
from llmgw.render.errors import UPSTREAM_ERROR_RULES, upstream_refusals
from llmgw.render.filters import MAX_REASON_BYTES, upstream_status_lua
from tests.lua_harness import lua_runtime, lua_table

ADMITTED = {Key.CLUSTER: "provider_demo"}


@pytest.fixture(scope="module")
def lua() -> Any:
    return lua_runtime(upstream_status_lua(upstream_refusals()))


def answer(lua: Any, status: int, body: bytes, md: dict[str, str] | None = None,
           headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, metadata set) as the answer leaves the filter."""
    hdrs = {":status": str(status), "content-type": "application/json", "content-length": str(len(body)),
            **(headers or {})}
    out, got, sets = lua.globals().run_response(lua_table(lua, dict(ADMITTED if md is None else md)),
                                                lua_table(lua, hdrs), body)
    return (int(got[b":status"]), body if out is None else out,
            {k.decode(): v.decode() for k, v in sets.items()})


def reason(body: bytes) -> str:
    """The message of the contract's error the caller gets, past the gateway's own words."""
    doc = json.loads(body)
    assert doc["error"]["code"] == ErrorCode.INVALID_REQUEST.value
    prefix, _, said = doc["error"]["message"].partition(": ")
    assert prefix.startswith("the upstream rejected the request as ")
    return said


@pytest.mark.parametrize(("body", "said"), [
    # OpenAI, Anthropic, Gemini, vLLM (newer) and a proxy: error.message
    ({"error": {"message": "max_tokens is too large: 99999", "type": "invalid_request_error"}},
     "max_tokens is too large: 99999"),
    ({"type": "error", "error": {"type": "invalid_request_error", "message": "messages: roles must alternate"}},
     "messages: roles must alternate"),
    ({"error": {"code": 400, "message": "Invalid JSON payload received.", "status": "INVALID_ARGUMENT"}},
     "Invalid JSON payload received."),
    ({"error": "model not found"}, "model not found"),
    # Bedrock and vLLM: message
    ({"message": "Malformed input request: #: extraneous key [top_k] is not permitted"},
     "Malformed input request: #: extraneous key [top_k] is not permitted"),
    ({"object": "error", "message": "This model's maximum context length is 8192 tokens.", "code": 400},
     "This model's maximum context length is 8192 tokens."),
    # a validation error's detail: a string, or a list of {msg}
    ({"detail": "temperature must be at most 2"}, "temperature must be at most 2"),
    ({"detail": [{"loc": ["body", "n"], "msg": "Input should be less than 9", "type": "less_than"}]},
     "Input should be less than 9"),
    # escapes and whitespace as the caller reads them; a surrogate left unpaired is no character
    ({"error": {"message": "tool \"search\"\n  has no\tschema \u00e9"}}, 'tool "search" has no schema \u00e9'),
    ({"message": "bad \ud800 here \ud83d\ude00"}, "bad \ufffd here \U0001f600"),
])
def test_an_upstreams_reason_reaches_the_caller_and_the_metadata(lua: Any, body: dict[str, Any], said: str) -> None:
    status, out, sets = answer(lua, 400, json.dumps(body).encode())
    assert status == 400
    assert reason(out) == said
    assert sets[Key.UPSTREAM_MESSAGE] == said
    assert sets[Key.UPSTREAM_STATUS] == "400"  # the upstream's own, recorded as before


@pytest.mark.parametrize(("upstream", "caller", "words"), [
    (400, 400, "as invalid"), (413, 413, "as too large"), (422, 400, "as invalid")])
def test_each_refusal_status_keeps_its_contract_status_and_words(lua: Any, upstream: int, caller: int,
                                                                 words: str) -> None:
    status, out, sets = answer(lua, upstream, b'{"message": "no"}')
    assert status == caller and words in json.loads(out)["error"]["message"]
    assert sets[Key.UPSTREAM_STATUS] == str(upstream)
    assert {s for s, _, code, _ in UPSTREAM_ERROR_RULES if code is ErrorCode.INVALID_REQUEST} == {400, 413, 422}


@pytest.mark.parametrize(("status", "body", "md", "headers"), [
    (400, b'{"message": "no"}', {}, {}),  # not admitted (no cluster): Envoy's or ext_proc's own answer
    (500, b'{"message": "internal"}', None, {}),  # a failure, not a refusal: custom_response's 502
    (429, b'{"message": "slow down"}', None, {}),
    (400, b"<html>Bad Request</html>", None, {}),  # no reason to read: custom_response's own words
    (400, b'{"error": {"message": "   "}}', None, {}),
    (400, b'{"error": {"message": 7}}', None, {}),
    (400, b"", None, {}),
    (400, b'{"message": "big"}', None, {"content-length": str(1 << 20)}),  # no error document is this large
])
def test_what_is_no_refusal_with_a_reason_passes_as_it_came(lua: Any, status: int, body: bytes,
                                                            md: dict[str, str] | None, headers: dict[str, str]) -> None:
    got, out, sets = answer(lua, status, body, md, headers)
    assert (got, out) == (status, body)
    assert Key.UPSTREAM_MESSAGE not in sets and sets[Key.UPSTREAM_STATUS] == str(status)


def test_the_first_status_and_the_upstreams_request_id_are_kept(lua: Any) -> None:
    _, _, sets = answer(lua, 200, b"{}", headers={"x-amzn-requestid": "abc-123", "x-request-id": "other"})
    assert sets == {Key.UPSTREAM_STATUS: "200", Key.UPSTREAM_REQUEST_ID: "abc-123"}
    # Envoy's own reply after the upstream's headers passes too: the upstream's status stays
    _, _, sets = answer(lua, 413, b'{"message": "x"}', {**ADMITTED, Key.UPSTREAM_STATUS: "200"})
    assert sets == {}
    _, _, sets = answer(lua, 200, b"{}", headers={"request-id": "not an id; it has spaces"})
    assert Key.UPSTREAM_REQUEST_ID not in sets


def test_the_attempt_filters_own_refusal_is_marked_and_left_as_it_came(lua: Any) -> None:
    """A 429 the attempt filter wrote (the gateway's own refusal of an attempt, on a plan's route) is no
    upstream's refusal: marked so custom_response leaves it alone, its body untouched. The same header
    from an upstream on a route without the attempt filter is not believed: its answer is judged as any
    other's (the attempt filter strips it from an upstream's answer on a plan)."""
    body = b'{"error": {"message": "quota spent", "type": "rate_limit_error", "code": "overloaded", "param": null}}'
    hdrs = {Header.ATTEMPT_REFUSED: "1"}
    plan = {**ADMITTED, Key.PLAN: "acme|pool-llama-8b,demo-anthropic"}
    status, out, sets = answer(lua, 429, body, plan, headers=hdrs)
    assert (status, out) == (429, body)
    assert sets == {Key.UPSTREAM_STATUS: "429", Key.ATTEMPT_REFUSED: "1"}
    _, same, sets = answer(lua, 400, b'{"message": "bad"}', plan, headers=hdrs)  # a refusal status: not rewritten
    assert same == b'{"message": "bad"}' and Key.UPSTREAM_MESSAGE not in sets
    _, spoofed, sets = answer(lua, 400, b'{"message": "bad"}', headers=hdrs)  # no plan: an upstream's header
    assert Key.ATTEMPT_REFUSED not in sets and sets[Key.UPSTREAM_MESSAGE] == "bad" and spoofed != b'{"message": "bad"}'


# Secrets an upstream may echo back, each a kind the gateway's own redaction finds.
SECRETS = [
    "sk-proj-" + "Ab3dE" * 8, "sk-ant-api03-" + "x9Y_z" * 6, "AKIAIOSFODNN7EXAMPLE", "ASIA" + "Z3" * 8,
    "AIza" + "Sy8-_q" * 5 + "abcde", "ghp_" + "aB1" * 12, "gho_" + "Zz9" * 12,
]


@pytest.mark.parametrize("secret", SECRETS)
def test_a_secret_the_upstream_echoes_never_reaches_the_caller_or_the_ledger(lua: Any, secret: str) -> None:
    assert Redactor(frozenset({"secret"})).redact(secret) != secret  # the gateway's redaction calls it one
    said = f"Incorrect API key provided: {secret}. You can find your API key at the console."
    _, out, sets = answer(lua, 400, json.dumps({"error": {"message": said}}).encode())
    assert secret not in out.decode() and secret not in sets[Key.UPSTREAM_MESSAGE]
    assert reason(out) == "Incorrect API key provided: [REDACTED]. You can find your API key at the console."


@pytest.mark.parametrize(("said", "kept"), [
    ("Authorization: Bearer abcdefghijklmnop1234.qrstuv", "Authorization: Bearer [REDACTED]"),
    ("signature " + "Q2hlY2sgdGhpcyBvdXQ" * 3 + " does not match", "signature [REDACTED] does not match"),
    # what a caller needs to fix its request stays: ids, model names, numbers, short words
    ("request 3f2b8c1e-9d4a-4b7e-8f00-1a2b3c4d5e6f: anthropic.claude-3-5-sonnet-20240620-v1:0 takes 4096",
     "request 3f2b8c1e-9d4a-4b7e-8f00-1a2b3c4d5e6f: anthropic.claude-3-5-sonnet-20240620-v1:0 takes 4096"),
    ("Bearer token", "Bearer token"),
])
def test_tokens_are_redacted_and_the_reason_kept(lua: Any, said: str, kept: str) -> None:
    _, out, _ = answer(lua, 400, json.dumps({"message": said}).encode())
    assert reason(out) == kept


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the runtime holds no state between answers
@given(said=st.text(min_size=1, max_size=800))
def test_any_reason_is_bounded_whole_characters_and_valid_json(lua: Any, said: str) -> None:
    status, out, sets = answer(lua, 422, json.dumps({"detail": said}).encode())
    if status == 422:  # only whitespace: no reason
        assert not said.strip() and Key.UPSTREAM_MESSAGE not in sets
        return
    text = reason(out)  # the body parses: every character escaped as JSON requires
    assert len(text.encode()) <= MAX_REASON_BYTES + 3 and text == sets[Key.UPSTREAM_MESSAGE]
    text.encode().decode("utf-8")  # cut between characters


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the runtime holds no state between answers
@given(body=st.binary(max_size=600) | st.builds(
    lambda said, key: json.dumps({key: said}).encode(),
    st.text(st.characters(exclude_categories=()) | st.characters(  # lone surrogates among them
        min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()), max_size=200) | st.integers() | st.none(),
    st.sampled_from(["message", "detail", "error"])), status=st.sampled_from([400, 413, 422]))
def test_any_bytes_an_upstream_refuses_with_pass_or_become_the_contracts_error(lua: Any, body: bytes,
                                                                              status: int) -> None:
    """A provider's refusal body is not the gateway's to trust: whatever it holds, the filter never
    fails (Envoy would answer 500), and the caller gets it as it came or the contract's error."""
    got, out, sets = answer(lua, status, body)
    if Key.UPSTREAM_MESSAGE in sets:
        assert reason(out) == sets[Key.UPSTREAM_MESSAGE]
    else:
        assert (got, out) == (status, body)
