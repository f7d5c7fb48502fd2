"""The Gemini front door (issue 13): the real `google-genai` SDK, its base URL at the gateway, through
Envoy and ext_proc to the vLLM-shaped pool. The same stages run (identity by `x-goog-api-key` or
`?key=`, policy, budget, routing, metering); answers, streams and errors come back in Gemini's shape
with the contract's code as the ErrorInfo reason; the key never reaches an engine or a log line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google import genai
from google.genai import errors, types

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of
from tests.helpers import inject_fault, request, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
SEARCH = types.FunctionDeclaration(name="search_docs", description="search the docs", parameters_json_schema={
    "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}})


_clients: list[genai.Client] = []  # a Client closes its connection pool when collected: keep each


def client(stack: Stack, key: str = KEY) -> genai.Client:
    c = genai.Client(api_key=key, http_options=types.HttpOptions(base_url=stack.url, api_version="v1beta",
                                                                  retry_options=types.HttpRetryOptions(attempts=1)))
    _clients.append(c)
    return c


def config(**kw: Any) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(**kw)


def test_generate_content_from_the_pool(stack: Stack) -> None:
    r = client(stack).models.generate_content(model="chat-default", contents="hello gemini door",
                                              config=config(max_output_tokens=6, system_instruction="Be brief."))
    assert r.text and r.candidates and r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert r.usage_metadata and r.usage_metadata.candidates_token_count == 6
    assert (r.usage_metadata.prompt_token_count or 0) > 0
    # Metered like a chat completion: the ledger entry has the same usage.
    entry = ledger_of(stack, str(r.response_id), "acme")
    assert entry["usage"]["completion_tokens"] == 6
    assert entry["usage"]["prompt_tokens"] == r.usage_metadata.prompt_token_count


def test_a_stream_from_the_pool(stack: Stack) -> None:
    chunks = list(client(stack).models.generate_content_stream(model="chat-default", contents="stream please",
                                                               config=config(max_output_tokens=7)))
    assert "".join(c.text or "" for c in chunks)
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert last.usage_metadata and last.usage_metadata.candidates_token_count == 7


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_from_the_pool(stack: Stack, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "chat-default", "contents": "use search_docs for the ledger", "config": config(
        max_output_tokens=200, tools=[types.Tool(function_declarations=[SEARCH])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))}
    if stream:
        calls = [c for chunk in client(stack).models.generate_content_stream(**kw) for c in chunk.function_calls or []]
    else:
        calls = client(stack).models.generate_content(**kw).function_calls or []
    (call,) = calls
    assert call.name == "search_docs" and isinstance((call.args or {})["query"], str)


def test_a_function_result_is_answered_in_text(stack: Stack) -> None:
    contents = [types.Content(role="user", parts=[types.Part(text="use search_docs")]),
                types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(
                    name="search_docs", args={"query": "ledger"}))]),
                types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                    name="search_docs", response={"result": "found it"}))])]
    r = client(stack).models.generate_content(model="chat-default", contents=contents, config=config(
        max_output_tokens=8, tools=[types.Tool(function_declarations=[SEARCH])]))
    assert r.text and not r.function_calls


def test_errors_are_googles_with_the_contracts_code(stack: Stack) -> None:
    with pytest.raises(errors.ClientError) as nf:
        client(stack).models.generate_content(model="no-such-route", contents="x")
    assert nf.value.code == 404 and nf.value.status == "NOT_FOUND"
    assert nf.value.details["error"]["details"][0]["reason"] == "route_not_found"
    with pytest.raises(errors.ClientError) as auth:
        client(stack, "wrong-key").models.generate_content(model="chat-default", contents="x")
    assert auth.value.code == 401 and auth.value.details["error"]["details"][0]["reason"] == "unauthenticated"
    with pytest.raises(errors.ClientError) as unsupported:
        client(stack).models.generate_content(model="chat-default", contents="x", config=config(
            safety_settings=[types.SafetySetting(category=types.HarmCategory.HARM_CATEGORY_HARASSMENT,
                                                 threshold=types.HarmBlockThreshold.BLOCK_NONE)]))
    assert unsupported.value.code == 400
    assert unsupported.value.details["error"]["details"][0]["reason"] == "unsupported_field"
    marker = inject_fault(stack.engine_urls(), "status=503", count=4)
    with pytest.raises(errors.ServerError) as upstream:
        client(stack).models.generate_content(model="chat-default", contents=marker)
    assert upstream.value.code == 502 and upstream.value.details["error"]["details"][0]["reason"] == "upstream_error"


def test_envoys_own_replies_are_googles_too(stack: Stack) -> None:
    marker = inject_fault(stack.engine_urls(), "delay_ms=3000", count=4)
    r = request(f"{stack.url}/v1beta/models/chat-default:generateContent", "POST",
                {"contents": [{"parts": [{"text": marker}]}]}, {"x-goog-api-key": KEY, "x-llmgw-deadline-ms": "300"})
    assert r.status == 504 and r.json()["error"]["status"] == "DEADLINE_EXCEEDED"
    assert r.json()["error"]["details"][0]["reason"] == "deadline_exceeded"
    assert r.json()["error"]["code"] == 504  # Google's integer (Envoy wrote "504.0": issue 27)
    empty = request(f"{stack.url}/v1beta/models/chat-default:generateContent", "POST", None, {"x-goog-api-key": KEY})
    assert empty.status == 400 and empty.json()["error"]["code"] == 400
    assert empty.json()["error"]["status"] == "INVALID_ARGUMENT"
    chat = request(f"{stack.url}/v1/chat/completions", "POST", {"model": "chat-default", "messages": [
        {"role": "user", "content": marker}]}, {"authorization": f"Bearer {KEY}", "x-llmgw-deadline-ms": "300"})
    assert chat.status == 504 and chat.json()["error"]["code"] == "deadline_exceeded"  # the contract's own shape


def test_a_stream_must_be_server_sent_events(stack: Stack) -> None:
    body = {"contents": [{"parts": [{"text": "x"}]}]}
    r = request(f"{stack.url}/v1beta/models/chat-default:streamGenerateContent", "POST", body, {"x-goog-api-key": KEY})
    assert r.status == 400 and r.json()["error"]["details"][0]["reason"] == "invalid_request"


def test_a_broken_stream_ends_with_an_error_response(stack: Stack) -> None:
    marker = inject_fault(stack.engine_urls(), "malformed_after=2")
    r = request(f"{stack.url}/v1beta/models/chat-default:streamGenerateContent?alt=sse", "POST",
                {"contents": [{"parts": [{"text": marker}]}]}, {"x-goog-api-key": KEY})
    frames = [json.loads(e[6:]) for e in r.body.decode().split("\r\n\r\n") if e]
    assert frames[-1]["error"]["details"][0]["reason"] == "stream_interrupted"
    assert not any("finishReason" in c for f in frames[:-1] for c in f.get("candidates", []))


def test_the_key_in_the_query_never_reaches_an_engine_or_the_log(stack: Stack) -> None:
    marker = unique_marker("gkey")
    r = request(f"{stack.url}/v1beta/models/chat-default:streamGenerateContent?alt=sse&key={KEY}", "POST",
                {"contents": [{"parts": [{"text": marker}]}], "generationConfig": {"maxOutputTokens": 2}}, {})
    assert r.status == 200
    (entry,) = [e for u in stack.engine_urls() for e in request(f"{u}/admin/requests").json()
                if marker in json.dumps(e["messages"])]
    assert KEY not in entry["path"] and entry["path"].startswith("/v1/chat/completions")
    assert not entry["api_key_present"]
    assert KEY not in (stack.logs / "envoy.log").read_text()  # the access log keeps the path, not its query
    # Two different credentials (header and query): refused.
    two = request(f"{stack.url}/v1beta/models/chat-default:generateContent?key={DEMO_KEYS['globex']}", "POST",
                  {"contents": [{"parts": [{"text": "x"}]}]}, {"x-goog-api-key": KEY})
    assert two.status == 401
