"""A hostile or careless client through the real Envoy: every bad input is a complete 4xx in the
contract's shape, nothing a client sends that is meant for the gateway reaches an engine, no field
escapes authorization, budgets or redaction, and failures settle at once (issue 11)."""

from __future__ import annotations

import hashlib
import http.client
import json
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import yaml

from extproc.chat import prompt_bytes
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, start_stack
from tests.helpers import (
    assert_contract_body,
    assert_contract_error,
    chat_body,
    clear_faults,
    inject_fault,
    llmgw,
    raw_exchange,
    raw_post,
    request,
    stream_raw,
)

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
AUTH = {"authorization": f"Bearer {KEY}"}
BROKE_KEY = "sk-test-broke-0123456789"  # a tenant whose budget holds nothing
ENGINE_HEADERS = {"host", "content-type", "content-length", "x-request-id", "x-forwarded-proto", "traceparent",
                  "tracestate", "x-envoy-expected-rq-timeout-ms", "x-envoy-attempt-count"}


def hardened_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["envoy"].update(request_timeout_ms=1500, request_headers_timeout_ms=1000, idle_connection_timeout_ms=5000)
    gw["tenants"]["broke"] = {"default_data_class": "public", "allowed_data_classes": ["public"],
                              "api_keys": [{"id": "broke-1", "sha256": hashlib.sha256(BROKE_KEY.encode()).hexdigest()}]}
    gw["budgets"].append({"name": "broke-zero", "tenant": "broke", "window": "total", "limit_tokens": 0})
    gw["store"]["lease_grace_ms"] = 500
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


gw = module_stack("hardening", hardened_policy)


def chat(s: Stack, body: Any, headers: dict[str, str] | None = None, timeout: float = 30) -> Any:
    return request(f"{s.url}/v1/chat/completions", "POST", body, {**AUTH, **(headers or {})}, timeout=timeout)


def engine_entries(s: Stack, marker: str) -> list[dict[str, Any]]:
    return [e for u in s.engine_urls() for e in request(f"{u}/admin/requests").json()
            if marker in json.dumps(e["messages"])]


def tracebacks(s: Stack) -> list[str]:
    return [f.name for f in s.logs.glob("extproc-*.log") if "Traceback" in f.read_text(errors="replace")]


# -- headers --------------------------------------------------------------------------------------

def test_client_headers_never_reach_an_engine(gw: Stack) -> None:
    """Only an allow-list travels upstream: cookies, other credentials, the gateway's own headers, the
    simulator's fault header, junk. A client's trace context goes on only when valid."""
    marker = uuid.uuid4().hex
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    sent = {"cookie": "session=abc", "x-api-key": "k-1", "proxy-authorization": "Basic eDp5",
            "x-llmgw-data-class": "public", "x-llmgw-anything": "1", "x-enginesim-fault": "exit",
            "idempotency-key": f"idem-{marker}", "user-agent": "probe/1", "x-junk": "j" * 60_000,
            "x-envoy-retry-on": "5xx", "traceparent": traceparent, "tracestate": "vendor=1"}
    r = chat(gw, chat_body(content=marker, max_tokens=2), sent)
    assert r.status == 200, r.body[:300]
    (entry,) = engine_entries(gw, marker)
    assert set(entry["headers"]) <= ENGINE_HEADERS, set(entry["headers"]) - ENGINE_HEADERS
    # The client's trace continues upstream under the gateway's span for the request
    # (tests/e2e/operations/test_traces_e2e.py).
    sent_tp = entry["headers"]["traceparent"].split("-")
    assert sent_tp[1] == traceparent.split("-")[1] and sent_tp[2] != traceparent.split("-")[2] and sent_tp[3] == "01"
    assert entry["headers"]["tracestate"] == "vendor=1"
    assert entry["authorization_present"] is False
    assert all(e.startswith("http") and request(f"{e}/health").status == 200 for e in gw.engine_urls())

    bad = uuid.uuid4().hex
    r = chat(gw, chat_body(content=bad, max_tokens=2), {"traceparent": "00-zz-zz-01", "tracestate": "vendor=1"})
    assert r.status == 200
    (entry,) = engine_entries(gw, bad)
    # A malformed traceparent is ignored: the gateway starts a trace of its own, without the tracestate.
    assert "zz" not in entry["headers"]["traceparent"] and "tracestate" not in entry["headers"]


# -- bad input ------------------------------------------------------------------------------------

def _body(**extra: Any) -> bytes:
    return json.dumps({"model": "chat-default", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


DEEP = b'{"model":"chat-default","messages":[{"role":"user","content":"x"}],"x":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
DEEP_SCHEMA = (b'{"model":"chat-default","messages":[{"role":"user","content":"x"}],"response_format":{"type":'
               b'"json_schema","json_schema":{"name":"a","schema":' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}}}")
AUTH_OK = (b"authorization", b"Bearer " + KEY.encode())
BAD_INPUT = [
    ("deep_unknown_field", [AUTH_OK], DEEP, 400, "invalid_request"),
    ("deep_known_field", [AUTH_OK], DEEP_SCHEMA, 400, "invalid_request"),
    ("lone_surrogate", [AUTH_OK],
     b'{"model":"chat-default","messages":[{"role":"user","content":"\\ud800"}]}', 400, "invalid_request"),
    ("max_tokens_1e30", [AUTH_OK], _body(max_tokens=10**30), 400, "invalid_request"),
    ("deadline_superscript", [AUTH_OK, (b"x-llmgw-deadline-ms", "²".encode())], _body(), 400, "invalid_request"),
    ("authorization_not_utf8", [(b"authorization", b"Bearer \xff\xfe" + KEY.encode())], _body(), 401,
     "unauthenticated"),
    ("data_class_not_utf8", [AUTH_OK, (b"x-llmgw-data-class", b"inter\xffnal")], _body(), 400, "invalid_request"),
    ("idempotency_key_not_utf8", [AUTH_OK, (b"idempotency-key", b"k\xff")], _body(), 400, "invalid_request"),
    ("deadline_not_utf8", [AUTH_OK, (b"x-llmgw-deadline-ms", b"1\xff0")], _body(), 400, "invalid_request"),
    ("user_agent_not_utf8", [AUTH_OK, (b"user-agent", b"\xff\xfe")], _body(), 200, ""),
    ("trace_context_not_utf8", [AUTH_OK, (b"traceparent", b"\xff"), (b"tracestate", b"\xfe")], _body(), 200, ""),
    ("legacy_functions", [AUTH_OK], _body(functions=[{"name": "update_ticket", "parameters": {}}]), 400,
     "unsupported_field"),
    ("legacy_function_call", [AUTH_OK], _body(function_call="auto"), 400, "unsupported_field"),
    ("vllm_chat_template", [AUTH_OK], _body(chat_template="{{ messages }}"), 400, "unsupported_field"),
    ("image_part", [AUTH_OK], json.dumps({"model": "chat-default", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}).encode(), 400, "unsupported_field"),
    ("n_over_the_limit", [AUTH_OK], _body(n=99), 400, "invalid_request"),
    ("tool_choice_not_offered", [AUTH_OK], _body(tool_choice={"type": "function", "function": {"name": "x"}}),
     400, "invalid_request"),
]


@pytest.mark.parametrize(("name", "headers", "body", "status", "code"), BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_complete_contract_answer(gw: Stack, name: str, headers: list[tuple[bytes, bytes]],
                                                 body: bytes, status: int, code: str) -> None:
    resp = raw_exchange(gw.url, raw_post("/v1/chat/completions", body, [(b"content-type", b"application/json"),
                                                                        *headers]))
    assert resp is not None and resp.complete, name
    assert resp.status == status, (name, resp.status, resp.body[:300])
    assert resp.headers.get("x-llmgw-route-revision"), resp.headers
    if code:
        assert assert_contract_body(resp.status, resp.headers, resp.body)["code"] == code


def test_no_bad_input_leaves_a_traceback(gw: Stack) -> None:
    for _, headers, body, _, _ in BAD_INPUT:
        raw_exchange(gw.url, raw_post("/v1/chat/completions", body, [(b"content-type", b"application/json"),
                                                                     *headers]))
    assert not tracebacks(gw)


def test_a_write_tool_offered_as_a_legacy_function_never_passes(gw: Stack) -> None:
    """The demo key has no `write` grant: a write tool is 403 under `tools`, and `functions` (which
    would have escaped the tool check) is refused outright; the retry stage never sees it."""
    tool = {"type": "function", "function": {"name": "update_ticket", "parameters": {"type": "object"}}}
    assert_contract_error(chat(gw, chat_body(max_tokens=2, tools=[tool])), 403, "forbidden")
    err = assert_contract_error(chat(gw, chat_body(max_tokens=2, functions=[tool["function"]])), 400,
                                "unsupported_field")
    assert err["param"] == "functions"
    history = chat_body(max_tokens=2)
    history["messages"] = [{"role": "user", "content": "x"},
                           {"role": "assistant", "content": None, "function_call": {"name": "update_ticket",
                                                                                    "arguments": "{}"}},
                           {"role": "user", "content": "go on"}]
    assert assert_contract_error(chat(gw, history), 400, "unsupported_field")["param"] == "messages[1].function_call"


# -- what a reservation covers ---------------------------------------------------------------------

def test_n_completions_are_reserved_n_times(gw: Stack) -> None:
    body = chat_body(max_tokens=5, n=3, ignore_eos=True)
    r = chat(gw, body)
    assert r.status == 200 and len(r.json()["choices"]) == 3
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    # The prompt bound (UTF-8 bytes + 8 per message) plus max_tokens for each of the 3 completions,
    # and the engine produced (and was charged) all three.
    assert entry["reserved_tokens"] == prompt_bytes(body) + 8 + 3 * 5
    assert entry["n"] == 3 and entry["usage"]["completion_tokens"] == 15
    assert entry["charged_tokens"] == entry["usage"]["prompt_tokens"] + 15 <= entry["reserved_tokens"]


def test_tool_calls_in_the_conversation_count_toward_the_prompt_bound(gw: Stack) -> None:
    args = json.dumps({"text": "y" * 2000})
    body = chat_body(max_tokens=5)
    body["messages"] = [{"role": "user", "content": "x"},
                        {"role": "assistant", "content": None, "name": "helper",
                         "tool_calls": [{"id": "call_1", "type": "function",
                                         "function": {"name": "search_docs", "arguments": args}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = chat(gw, body)
    assert r.status == 200, r.body[:300]
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["reserved_tokens"] >= len(args) + 5 and entry["reserved_tokens"] == prompt_bytes(body) + 3 * 8 + 5


def test_an_impossible_size_is_400_before_budget_and_bulkhead(gw: Stack) -> None:
    broke = {"authorization": f"Bearer {BROKE_KEY}"}
    assert_contract_error(chat(gw, chat_body(max_tokens=4), broke), 429, "budget_exhausted")
    r = chat(gw, chat_body(max_tokens=1_000_000), broke)
    assert assert_contract_error(r, 400, "context_length_exceeded")["param"] == "max_tokens"
    assert "retry-after" not in r.headers  # nothing to wait for


# -- paths and Envoy's own answers ----------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/foo"), ("POST", "/v1/chat"), ("GET", "/v1/chat/completions/x"), ("GET", "/v1"), ("DELETE", "/other"),
    ("POST", "/v1/completions")])
def test_unknown_paths_are_404_naming_what_is_served_and_ledgered(gw: Stack, method: str, path: str) -> None:
    r = request(f"{gw.url}{path}?key=secret", method, {"prompt": "x"} if method == "POST" else None, AUTH)
    message = assert_contract_error(r, 404, "route_not_found")["message"]
    assert message.startswith(f"no such endpoint: {method} {path}; this gateway serves POST /v1/chat/completions, ")
    assert "POST /v1/responses" in message and "POST /v1/messages" in message and "secret" not in message
    assert r.headers["x-llmgw-route-revision"] == gw.snapshot.revision
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert (entry["status"], entry["error"], entry["endpoint"], entry.get("route")) == (
        404, "route_not_found", f"{method} {path}", None)
    # who is asking comes first: an unknown caller learns nothing else
    assert_contract_error(request(f"{gw.url}{path}", method), 401, "unauthenticated")


def test_models_retrieve_through_the_sdk(gw: Stack) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve("chat-default").id == "chat-default"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-route")
    assert e.value.code == "route_not_found"
    assert [m["id"] for m in request(f"{gw.url}/v1/models/", headers=AUTH).json()["data"]] == sorted(gw.snapshot.routes)
    assert_contract_error(request(f"{gw.url}/v1/models/chat-default"), 401, "unauthenticated")


PROTOCOL_ERRORS = [
    ("too_many_headers", b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n"
     + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"\r\n"),
    ("header_of_100kb", b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("content_length_and_chunked", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("two_content_lengths", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n"
     b"Content-Length: 6\r\n\r\nhello"),
    ("bad_host", b"GET /v1/models HTTP/1.1\r\nHost: a b\r\n\r\n"),
    ("http_1_0", b"GET /v1/models HTTP/1.0\r\n\r\n"),
    ("connect", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
]


@pytest.mark.parametrize(("name", "data"), PROTOCOL_ERRORS, ids=[c[0] for c in PROTOCOL_ERRORS])
def test_protocol_rejections_are_complete_contract_errors(gw: Stack, name: str, data: bytes) -> None:
    resp = raw_exchange(gw.url, data)
    assert resp is not None and resp.complete, (name, resp)
    assert 400 <= resp.status < 500, (name, resp.status)
    assert_contract_body(resp.status, resp.headers, resp.body)
    assert resp.headers.get("x-llmgw-route-revision") == gw.snapshot.revision


def test_every_answer_names_the_revision(gw: Stack) -> None:
    for r in (request(f"{gw.url}/healthz"), request(f"{gw.url}/nope"), chat(gw, chat_body(max_tokens=2)),
              request(f"{gw.url}/v1/models"), request(f"{gw.url}/v1/chat/completions", "POST", b"", AUTH)):
        assert r.headers.get("x-llmgw-route-revision") == gw.snapshot.revision, (r.status, r.headers)


# -- slow clients ---------------------------------------------------------------------------------

def _time_until_closed(url: str, data: bytes, limit: float = 15.0) -> tuple[float, bytes]:
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    got = bytearray()
    with socket.create_connection((host, int(port)), timeout=limit) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return time.monotonic() - t0, bytes(got)


def test_a_body_shorter_than_its_length_is_cut_by_the_request_timeout(gw: Stack) -> None:
    seconds, got = _time_until_closed(gw.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                                              b"Content-Length: 100\r\n\r\n{\"a\":")
    assert seconds < 4, seconds  # request_timeout_ms 1500 in this policy
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert b'"code":"invalid_request"' in got and got.endswith(b"0\r\n\r\n")  # the contract's body, complete


def test_trickled_headers_are_cut_by_the_header_timeout(gw: Stack) -> None:
    seconds, got = _time_until_closed(gw.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: 1")
    assert seconds < 4, seconds  # request_headers_timeout_ms 1000
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:100]


# -- idempotency ----------------------------------------------------------------------------------

def test_an_idempotent_retry_right_after_the_answer_is_replayed(gw: Stack) -> None:
    marker = uuid.uuid4().hex
    body = chat_body(content=marker, max_tokens=4)
    headers = {"idempotency-key": f"k-{marker}"}
    first = chat(gw, body, headers)
    second = chat(gw, body, headers)  # at once: the answer was recorded before the client had it
    assert first.status == second.status == 200 and first.json()["model"] == body["model"]  # the route's name
    assert second.headers.get("x-llmgw-idempotent-replay") == "true" and second.body == first.body
    assert len(engine_entries(gw, marker)) == 1


def test_a_repeated_stream_is_replayed_not_run_again(gw: Stack) -> None:
    marker = uuid.uuid4().hex
    body = chat_body(content=marker, max_tokens=4, stream=True)
    headers = {**AUTH, "idempotency-key": f"k-{marker}"}
    status, rid, first = stream_raw(f"{gw.url}/v1/chat/completions", body, headers)
    assert status == 200 and first.rstrip().endswith(b"data: [DONE]")
    chunks = [json.loads(e[6:]) for e in first.decode().split("\n\n") if e.startswith("data: {")]
    assert chunks and all(c["model"] == body["model"] for c in chunks)  # named in ext_proc's guard too
    again = request(f"{gw.url}/v1/chat/completions", "POST", body, headers)
    assert again.status == 200 and again.headers["content-type"].startswith("text/event-stream")
    assert again.headers.get("x-llmgw-idempotent-replay") == "true" and again.body == first
    assert len(engine_entries(gw, marker)) == 1
    assert ledger_of(gw, rid, "acme")["settlement"] == "actual"  # charged once


def test_replays_are_sealed_at_rest(gw: Stack) -> None:
    """The route does not record content: the answer kept for a replay is encrypted in the store, and
    its text is nowhere in Valkey's append-only file."""
    marker = uuid.uuid4().hex
    r = chat(gw, chat_body(content=marker, max_tokens=24), {"idempotency-key": f"k-{marker}"})
    text = r.json()["choices"][0]["message"]["content"]
    assert len(text) > 30
    store = redis.Redis.from_url(str(gw.store_url), decode_responses=True)
    records = [store.hgetall(k) for k in store.scan_iter("llmgw:{acme}:idem:*")]
    assert records and all(rec.get("response", "v1:").startswith("v1:") for rec in records)
    store.execute_command("BGREWRITEAOF")
    time.sleep(0.5)
    aof = b"".join(p.read_bytes() for p in (gw.opts.state_dir / "valkey").rglob("*") if p.is_file())
    assert text.encode() not in aof and marker.encode() not in aof


# -- failures settle at once ----------------------------------------------------------------------

def _settled_within(s: Stack, rid: str, seconds: float) -> dict[str, Any]:
    t0 = time.monotonic()
    entry = ledger_of(s, rid, "acme")
    assert time.monotonic() - t0 < seconds
    return entry


def test_an_upstream_error_before_any_byte_is_released_at_once_and_frees_the_key(gw: Stack) -> None:
    for stream in (False, True):
        marker = inject_fault(gw.engine_urls(), "status=503", count=2)
        body = chat_body(content=marker, max_tokens=4, stream=stream)
        headers = {"idempotency-key": f"k-{marker}"}
        r = chat(gw, body, headers)
        assert_contract_error(r, 502, "upstream_error")
        entry = _settled_within(gw, r.headers["x-request-id"], 3)
        assert entry["settlement"] == "released" and entry["charged_micros"] == 0, entry
        clear_faults(gw.engine_urls())
        retry = chat(gw, body, headers)  # the key is free: the retry runs (and the engine is well now)
        assert retry.status == 200, retry.body[:200]


def test_a_client_that_gives_up_before_the_answer_is_settled_at_once(gw: Stack) -> None:
    marker = inject_fault(gw.engine_urls(), "delay_ms=2000")
    body = chat_body(content=marker, max_tokens=4)
    headers = {**AUTH, "idempotency-key": f"k-{marker}"}
    with pytest.raises((TimeoutError, socket.timeout)):
        request(f"{gw.url}/v1/chat/completions", "POST", body, headers, timeout=0.5)
    (seen,) = engine_entries(gw, marker)  # the engine got it (its log names Envoy's request id)
    entry = _settled_within(gw, seen["request_id"], 5)
    # A JSON answer is generated before its headers: what the engine did is unknown, so the whole
    # reservation is charged - at once, not after the lease - and the key stays ambiguous (invariant
    # 21): the retry is refused, naming the request, until the operator resolves the key.
    assert entry["termination"] == "client_cancel" and entry["settlement"] == "ambiguous"
    assert entry["charged_micros"] == entry["reserved_micros"]
    clear_faults(gw.engine_urls())
    refused = chat(gw, body, {"idempotency-key": f"k-{marker}"})
    assert_contract_error(refused, 409, "idempotency_ambiguous")
    assert seen["request_id"] in refused.json()["error"]["message"]
    resolved = llmgw("ledger", "resolve", "--idempotency-key", f"k-{marker}", "--config", str(gw.opts.config_dir),
                     "--store-url", str(gw.store_url), "--tenant", "acme")
    assert resolved.returncode == 0, resolved.stderr
    assert chat(gw, body, {"idempotency-key": f"k-{marker}"}).status == 200


# Counts no engine would report: each would refund (negative), drain (past 2^53) or fool (not a whole
# number) a budget if it were charged as it came.
UNBELIEVABLE_COUNTS = ["-7", "1e300", "2.5", '"7"', "true"]


@pytest.mark.parametrize("path", ["json", "lua-guard", "extproc-guard"])
def test_usage_no_engine_would_report_is_charged_as_unknown(gw: Stack, path: str) -> None:
    """The engine reports a completion count that is no count: not believed, whichever reads it
    (json_to_metadata and the access log, the Lua stream guard, ext_proc's guard) - the whole
    reservation is charged, as for an answer without usage, and nothing is refunded."""
    for value in UNBELIEVABLE_COUNTS:
        marker = inject_fault(gw.engine_urls(), f"usage={value}")
        headers = {"idempotency-key": f"k-{marker}"} if path == "extproc-guard" else {}
        r = chat(gw, chat_body(content=marker, max_tokens=4, stream=path != "json"), headers)
        assert r.status == 200, r.body[:200]
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        assert (entry["termination"], entry["settlement"]) == ("complete", "ambiguous"), (value, entry)
        assert entry["charged_micros"] == entry["reserved_micros"] > 0, (value, entry)
        # and it is kept out of the ledger's usage, which the metrics and cost exports sum
        assert (entry["usage_source"], entry["usage"]) == ("unbelievable", None), (value, entry)


# -- content and logs -----------------------------------------------------------------------------

def test_client_chosen_strings_in_denials_are_kept_out_of_logs(gw: Stack) -> None:
    card = "4111111111111111"  # a valid function name, and a card number
    # An unlisted tool on confidential data: acme admits it taken to run commands, which that class bars.
    r = chat(gw, chat_body(max_tokens=2, tools=[{"type": "function", "function": {"name": card}}]),
             {"x-llmgw-data-class": "confidential"})
    assert_contract_error(r, 403, "forbidden")
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert card not in json.dumps(entry) and any("[PAYMENT_CARD_1]" in x for x in entry["decision"]["reasons"])
    time.sleep(0.5)  # Envoy flushes its access log every 250 ms
    assert card not in (gw.logs / "envoy.log").read_text(errors="replace")


def test_every_rendered_field_is_redacted(gw: Stack) -> None:
    """acme's default data class (internal) requires redaction: names, tool call ids and arguments,
    reasoning and tool descriptions and schemas reach the engine with placeholders only."""
    email, card = "jane.doe@example.com", "4111 1111 1111 1111"
    marker = uuid.uuid4().hex
    body = chat_body(max_tokens=2, tools=[{"type": "function", "function": {
        "name": "search_docs", "description": f"ask {email}",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": card}}}}}])
    body["messages"] = [
        {"role": "user", "content": f"{marker} write to {email}", "name": email},
        {"role": "assistant", "content": None, "reasoning_content": f"card {card}",
         "tool_calls": [{"id": f"call-{email}", "type": "function",
                         "function": {"name": "search_docs", "arguments": json.dumps({"to": email, "card": card})}}]},
        {"role": "tool", "tool_call_id": f"call-{email}", "content": f"sent to {email}"}]
    r = chat(gw, body)
    assert r.status == 200, r.body[:300]
    (entry,) = engine_entries(gw, marker)
    sent = json.dumps(entry["messages"])
    assert email not in sent and card not in sent and "[EMAIL_1]" in sent and "[PAYMENT_CARD_1]" in sent
    args = entry["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"to": "[EMAIL_1]", "card": "[PAYMENT_CARD_1]"}  # still valid JSON
    assert entry["messages"][2]["tool_call_id"] == entry["messages"][1]["tool_calls"][0]["id"]


# -- the worker's life ----------------------------------------------------------------------------

def test_admitted_requests_outlive_the_worker_that_decided_them(tmp_path: Path) -> None:
    policy = hardened_policy(tmp_path)
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["deadline_ms"], route["max_stream_ms"] = 3000, 2000  # short leases: the sweeper settles soon
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    s = start_stack(tmp_path / "state", policy)
    try:
        # Within the stream's time to first byte (its 3 s deadline, shared with one retry: 1.5 s).
        marker = inject_fault(s.engine_urls(), "delay_ms=1000", count=2)
        results: dict[str, Any] = {}

        def json_call() -> None:
            results["json"] = chat(s, chat_body(content=marker, max_tokens=3))

        def stream_call() -> None:
            results["stream"] = stream_raw(f"{s.url}/v1/chat/completions",
                                           chat_body(content=marker, max_tokens=3, stream=True), AUTH)
        threads = [threading.Thread(target=json_call), threading.Thread(target=stream_call)]
        for t in threads:
            t.start()
        time.sleep(0.6)  # both admitted, both waiting on the engine
        (worker,) = s.extprocs
        worker.proc.kill()  # type: ignore[union-attr]
        worker.proc.wait(5)  # type: ignore[union-attr]
        for t in threads:
            t.join(15)
        assert results["json"].status == 200 and results["json"].json()["choices"]
        status, rid, raw = results["stream"]
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
        worker.start()  # as the supervisor would: its sweeper settles what the dead one could not
        for request_id in (results["json"].headers["x-request-id"], rid):
            deadline = time.monotonic() + 15
            while True:
                try:
                    ledger_of(s, request_id, "acme")
                    break
                except AssertionError:
                    assert time.monotonic() < deadline, f"{request_id} never settled"
    finally:
        s.stop()


def test_a_dead_engine_is_retried_around_without_retry_overflow(tmp_path: Path) -> None:
    s = start_stack(tmp_path / "state", hardened_policy(tmp_path))
    try:
        victim = s.engines[s.engine_urls("engine-pool")[0].removeprefix("http://")]
        victim.proc.kill()  # type: ignore[union-attr]
        victim.proc.wait(5)  # type: ignore[union-attr]
        out: list[int] = []
        threads = [threading.Thread(target=lambda: out.append(chat(s, chat_body(max_tokens=2)).status))
                   for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert out == [200] * 16, out
        stats = request(f"{s.admin_url}/stats?filter=pool_engine-pool").body.decode()
        counters = dict(line.split(": ") for line in stats.splitlines() if ": " in line)
        assert counters.get("cluster.pool_engine-pool.upstream_rq_retry_overflow") == "0", stats
        assert int(counters.get("cluster.pool_engine-pool.outlier_detection.ejections_enforced_total", "0")) >= 1
    finally:
        s.stop()


def test_raw_http_client_sees_complete_answers(gw: Stack) -> None:
    """The raw reader used above, checked on a normal answer (so a broken reader cannot pass them)."""
    conn = http.client.HTTPConnection(*gw.url.removeprefix("http://").split(":"))
    conn.request("GET", "/healthz")
    expected = conn.getresponse().read()
    resp = raw_exchange(gw.url, b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert resp is not None and resp.complete and resp.status == 200 and resp.body == expected
    cut = raw_exchange(gw.url, b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
    assert cut is not None and cut.complete


def test_a_route_without_budgets_is_served_with_the_same_header_allow_list(tmp_path: Path) -> None:
    """Without budgets no response filter looks the route up before the allow-list strips the client's
    headers, so the router matches on what is left: Envoy's own x-forwarded-proto must stay (a
    benchmark found every such request 404 when it did not)."""
    policy = hardened_policy(tmp_path)
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["budget_reservation"] = "off"
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    s = start_stack(tmp_path / "state", policy, with_valkey=False)
    try:
        marker = uuid.uuid4().hex
        r = chat(s, chat_body(content=marker, max_tokens=2), {"cookie": "c=1"})
        assert r.status == 200, r.body[:300]
        (entry,) = engine_entries(s, marker)
        assert set(entry["headers"]) <= ENGINE_HEADERS
    finally:
        s.stop()
