"""The served path against real vLLM: the openai SDK -> Envoy -> ext_proc -> vLLM (CPU build)."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS
from tests.helpers import assert_contract_error, chat_body, request, unique_marker
from tests.promtext import scrape, value

ACME, GLOBEX = DEMO_KEYS["acme"], DEMO_KEYS["globex"]


def sdk(stack: Stack, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_non_streaming(vllm_stack: Stack) -> None:
    raw = sdk(vllm_stack).chat.completions.with_raw_response.create(
        model="chat-default", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    c = raw.parse()
    assert c.object == "chat.completion" and c.choices[0].message.role == "assistant"
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage is not None and 0 < c.usage.completion_tokens <= 8
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.id == f"chatcmpl-{raw.headers['x-request-id']}"  # vLLM took Envoy's request id
    assert raw.headers["x-llmgw-deployment"] == "pool-llama-8b" and raw.headers["x-llmgw-attempts"] == "1"


def test_streaming_with_usage(vllm_stack: Stack) -> None:
    stream = sdk(vllm_stack).chat.completions.create(
        model="chat-default", messages=[{"role": "user", "content": "Stream"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(vllm_stack: Stack) -> None:
    r = request(f"{vllm_stack.url}/v1/chat/completions", "POST", chat_body(max_tokens=3, stream=True),
                {"authorization": f"Bearer {ACME}"}, timeout=60)
    assert r.status == 200 and r.body.decode().rstrip().endswith("data: [DONE]")


def test_refusals_in_front_of_vllm(vllm_stack: Stack) -> None:
    url = f"{vllm_stack.url}/v1/chat/completions"
    assert_contract_error(request(url, "POST", chat_body(), {"authorization": "Bearer nope"}), 401, "unauthenticated")
    assert_contract_error(request(url, "POST", chat_body("nope"), {"authorization": f"Bearer {ACME}"}), 404,
                          "route_not_found")
    # vLLM's own 400 (max_tokens over its 1,024-token window) reaches the client in the contract's shape.
    assert_contract_error(request(url, "POST", chat_body(max_tokens=5000), {"authorization": f"Bearer {ACME}"},
                                  timeout=60), 400, "invalid_request")


def test_models(vllm_stack: Stack) -> None:
    assert [m.id for m in sdk(vllm_stack).models.list().data] == sorted(vllm_stack.snapshot.routes)


def test_client_cancel_stops_generation_in_vllm(vllm_stack: Stack, vllm_url: str) -> None:
    """Cancel through Envoy: Envoy resets the upstream request and vLLM aborts it (it stops
    generating and leaves the batch; vLLM 0.32 does not count it in request_success_total)."""
    before = scrape(vllm_url)
    body = json.dumps(chat_body(max_tokens=900, stream=True, ignore_eos=True)).encode()
    host, port = vllm_stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {ACME}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while data.count(b"data:") < 5:
            data += s.recv(4096)
    deadline = time.monotonic() + 20
    while value(scrape(vllm_url), "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = scrape(vllm_url)
    assert value(after, "vllm:num_requests_running") == 0
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert 1 <= generated < 600, generated  # stopped far short of the 900 it would make with ignore_eos
    assert value(after, "vllm:request_success_total") == value(before, "vllm:request_success_total")


def _hits(url: str) -> float:
    """vLLM's prefix-cache hits, once the counter has settled: its metrics trail the answers (a CI
    run read another request's 896 hits land between two reads), so it is read until it stays put
    for half a second."""
    last, since = value(scrape(url), "vllm:prefix_cache_hits_total"), time.monotonic()
    deadline = since + 5
    while time.monotonic() - since < 0.5 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = value(scrape(url), "vllm:prefix_cache_hits_total")
        if now != last:
            last, since = now, time.monotonic()
    return last


def test_prefix_cache_hits_within_a_tenant_never_across(vllm_stack: Stack, vllm_url: str) -> None:
    """Invariant 10 on real vLLM: the same ~600-token prompt from two tenants hits vLLM's prefix cache
    on a tenant's repeat, and never on the other tenant's first request."""
    prompt = unique_marker("salt") + " " + "the gateway keeps every tenant's cached prefixes apart " * 30
    body = chat_body(content=prompt, max_tokens=1)
    gained = []
    for key in (ACME, GLOBEX, ACME, GLOBEX):
        before = _hits(vllm_url)
        r = request(f"{vllm_stack.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {key}"},
                    timeout=60)
        assert r.status == 200, r.body
        gained.append(_hits(vllm_url) - before)
    acme_first, globex_first, acme_again, globex_again = gained
    assert acme_first == 0 and globex_first == 0, gained  # globex met acme's cached prompt: no hit
    assert acme_again >= 256 and globex_again >= 256, gained  # each tenant hits its own blocks


@pytest.mark.parametrize("salt", ["a", "b"])
def test_client_cache_salt_cannot_join_another_tenant(vllm_stack: Stack, vllm_url: str, salt: str) -> None:
    prompt = unique_marker("salt") + " " + "a client-chosen salt must not matter at all here " * 30
    for key in (ACME, GLOBEX):
        before = _hits(vllm_url)
        r = request(f"{vllm_stack.url}/v1/chat/completions", "POST", chat_body(content=prompt, max_tokens=1,
                                                                               cache_salt=salt),
                    {"authorization": f"Bearer {key}"}, timeout=60)
        assert r.status == 200
        assert _hits(vllm_url) == before  # same client salt, different tenants: no sharing


def test_picker_reads_real_vllm_metrics(vllm_url: str) -> None:
    from extproc.picker import parse_load

    load = parse_load(request(f"{vllm_url}/metrics").body.decode(), at=0.0)
    assert load.waiting >= 0 and load.running >= 0 and 0.0 <= load.kv_usage <= 1.0


def test_requests_are_picked_from_real_metrics(vllm_stack: Stack, vllm_url: str) -> None:
    """The picker scored vLLM's live /metrics and named the engine; Envoy's override_host obeyed.
    (With stale or unreadable metrics the picker names nothing and `picked` stays empty.)"""
    r = request(f"{vllm_stack.url}/v1/chat/completions", "POST", chat_body(max_tokens=1),
                {"authorization": f"Bearer {ACME}"}, timeout=60)
    assert r.status == 200
    engine = vllm_url.removeprefix("http://")
    deadline = time.monotonic() + 5
    entry = None
    while entry is None and time.monotonic() < deadline:
        time.sleep(0.3)
        for line in (vllm_stack.logs / "envoy.log").read_text().splitlines():
            if line.startswith("{") and r.headers["x-request-id"] in line:
                entry = json.loads(line)
    assert entry is not None, "no access log line for the request"
    assert entry["picked"] == engine and entry["upstream"] == engine


def test_a_token_count_is_real_vllms_own(vllm_stack: Stack) -> None:
    """Anthropic's count_tokens through the gateway, counted by real vLLM's /tokenize with the chat
    template and the tools applied as for generation: the prompt tokens a generation then reports."""
    import anthropic

    client = anthropic.Anthropic(base_url=vllm_stack.url, api_key=ACME, max_retries=0, timeout=120)
    kw = {"model": "chat-default", "system": "Be brief.", "messages": [{"role": "user", "content": "count me"}],
          "tools": [{"name": "search_docs", "description": "search", "input_schema": {
              "type": "object", "properties": {"query": {"type": "string"}}}}]}
    counted = client.messages.count_tokens(**kw).input_tokens  # type: ignore[arg-type]
    used = client.messages.create(max_tokens=1, **kw).usage  # type: ignore[arg-type]
    assert counted == used.input_tokens + (used.cache_read_input_tokens or 0) > 0
