"""The served path end to end: the openai SDK -> real Envoy -> ext_proc -> simulated vLLM pool."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from typing import Any

import openai
import pytest

from llmgw.local.stack import Stack
from tests.helpers import assert_contract_error, chat_body, inject_fault, request

pytestmark = pytest.mark.e2e


def engine_log(stack: Stack) -> list[dict[str, Any]]:
    """What the engines received, each entry marked with the engine that received it."""
    out: list[dict[str, Any]] = []
    for url in stack.engine_urls():
        out += [{**e, "engine": url} for e in request(f"{url}/admin/requests").json()]
    return sorted(out, key=lambda e: e["time"])


def clear_engine_logs(stack: Stack) -> None:
    for url in stack.engine_urls():
        request(f"{url}/admin/requests", "DELETE")


def sdk(stack: Stack, key: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=30, **kw)


def test_non_streaming_completion(stack: Stack, acme_key: str) -> None:
    client = sdk(stack, acme_key)
    raw = client.chat.completions.with_raw_response.create(
        model="chat-default", messages=[{"role": "user", "content": "Say hello"}], max_tokens=12)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    h = raw.headers
    assert h["x-llmgw-route-revision"] == stack.snapshot.revision
    assert h["x-llmgw-deployment"] == "pool-llama-8b"
    assert h["x-llmgw-attempts"] == "1"
    # The request id Envoy assigned is the one the engine used (vLLM: chatcmpl-<X-Request-Id>).
    assert completion.id == f"chatcmpl-{h['x-request-id']}"


def test_streaming_with_usage(stack: Stack, acme_key: str) -> None:
    client = sdk(stack, acme_key)
    stream = client.chat.completions.create(
        model="chat-default", messages=[{"role": "user", "content": "Stream please"}], max_tokens=8,
        stream=True, stream_options={"include_usage": True})
    text, finish, usage, chunks = "", None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == chunks - 2  # role chunk + usage chunk
    assert usage.completion_tokens <= 8


def test_raw_stream_ends_with_done(stack: Stack, acme_key: str) -> None:
    resp = request(f"{stack.url}/v1/chat/completions", "POST",
                   chat_body(max_tokens=4, stream=True), {"authorization": f"Bearer {acme_key}"})
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    # A chunk that completes no event (the usage chunk withheld from a client that did not ask for it,
    # half an event) reaches the client as an SSE comment, which every SSE client skips.
    events = [e for e in resp.body.decode().split("\n\n") if e and not e.startswith(":")]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert e.startswith("data: ")
        json.loads(e[6:])


def test_fifty_concurrent_streams(stack: Stack, acme_key: str, globex_key: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.chat.completions.create(
            model="chat-default", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=16,
            stream=True, stream_options={"include_usage": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    async def main() -> list[int]:
        clients = [openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=k, max_retries=0, timeout=60)
                   for k in (acme_key, globex_key)]
        try:
            return await asyncio.gather(*(one(clients[i % 2], i) for i in range(50)))
        finally:
            for c in clients:
                await c.close()

    counts = asyncio.run(main())
    assert len(counts) == 50 and all(0 < c <= 16 for c in counts)


def test_models_lists_routes(stack: Stack, acme_key: str) -> None:
    models = sdk(stack, acme_key).models.list()
    assert [m.id for m in models.data] == sorted(stack.snapshot.routes)


def test_unknown_route_is_404(stack: Stack, acme_key: str) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        sdk(stack, acme_key).chat.completions.create(model="no-such-route",
                                                     messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 404
    assert exc.value.code == "route_not_found"


@pytest.mark.parametrize("headers", [
    {},
    {"authorization": "Bearer sk-not-a-key"},
    {"authorization": "Basic dXNlcjpwYXNz"},
    {"authorization": "Bearer "},
])
def test_bad_credentials_are_401_and_never_dispatched(stack: Stack, headers: dict[str, str]) -> None:
    clear_engine_logs(stack)
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(), headers)
    assert_contract_error(resp, 401, "unauthenticated")
    assert resp.headers["x-request-id"]
    assert resp.headers["x-llmgw-route-revision"] == stack.snapshot.revision
    assert engine_log(stack) == []  # invariant 1: nothing reached an upstream


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{not json", 400, "invalid_request"),
    (b"[1, 2]", 400, "invalid_request"),
    (json.dumps({"model": "chat-default"}).encode(), 400, "invalid_request"),
    (json.dumps({"model": "chat-default", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "invalid_request"),
    (json.dumps(chat_body(max_tokens=-1)).encode(), 400, "invalid_request"),
    (json.dumps(chat_body(stream="yes")).encode(), 400, "invalid_request"),
    (b"\xff\xfe\x00garbage", 400, "invalid_request"),
    (None, 400, "invalid_request"),  # no body at all
])
def test_malformed_requests_get_contract_errors(stack: Stack, acme_key: str, body: bytes | None,
                                                status: int, code: str) -> None:
    clear_engine_logs(stack)
    resp = request(f"{stack.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, status, code)
    assert engine_log(stack) == []


def test_huge_body_is_refused_in_contract_shape(stack: Stack, acme_key: str) -> None:
    limit = stack.snapshot.gateway.envoy.max_request_bytes
    body = chat_body(content="x" * (limit + 1024))
    resp = request(f"{stack.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 413, "invalid_request")


def test_unknown_path_is_404(stack: Stack, acme_key: str) -> None:
    resp = request(f"{stack.url}/v1/completions", "POST", {"prompt": "x"}, {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 404, "route_not_found")


def test_unknown_data_class_is_400_and_disallowed_is_403(stack: Stack, globex_key: str) -> None:
    auth = {"authorization": f"Bearer {globex_key}"}
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(),
                   {**auth, "x-llmgw-data-class": "top-secret"})
    assert_contract_error(resp, 400, "invalid_request")
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(),
                   {**auth, "x-llmgw-data-class": "confidential"})  # globex may not send confidential
    assert_contract_error(resp, 403, "forbidden")


def test_upstream_sees_served_model_and_no_gateway_credential(stack: Stack, acme_key: str) -> None:
    clear_engine_logs(stack)
    marker = uuid.uuid4().hex
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=marker, max_tokens=2),
                   {"authorization": f"Bearer {acme_key}"})
    assert resp.status == 200
    (entry,) = [e for e in engine_log(stack) if marker in json.dumps(e["messages"])]
    assert entry["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert entry["authorization_present"] is False
    assert entry["request_id"] == resp.headers["x-request-id"]


@pytest.mark.parametrize("status", [500, 503, 429])
def test_upstream_error_becomes_contract_error(stack: Stack, acme_key: str, status: int) -> None:
    marker = inject_fault(stack.engine_urls(), f"status={status}")
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=marker),
                   {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 502, "upstream_error")
    assert resp.headers["x-llmgw-deployment"] == "pool-llama-8b"
    assert resp.headers["x-llmgw-route-revision"] == stack.snapshot.revision


def test_upstream_503_through_sdk(stack: Stack, acme_key: str) -> None:
    client = sdk(stack, acme_key)
    marker = inject_fault(stack.engine_urls(), "status=503")
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="chat-default", messages=[{"role": "user", "content": marker}])
    assert exc.value.status_code == 502
    assert exc.value.code == "upstream_error"


def test_an_engines_own_400_is_a_contract_400(stack: Stack, acme_key: str) -> None:
    # The engine answers 400 in vLLM's shape (integer code); the client gets the contract's.
    marker = inject_fault(stack.engine_urls(), "status=400")
    resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=marker),
                   {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 400, "invalid_request")


def test_extproc_killed_fails_closed(fresh_stack: Stack, acme_key: str) -> None:
    stack = fresh_stack
    ok = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(max_tokens=2),
                 {"authorization": f"Bearer {acme_key}"})
    assert ok.status == 200
    for child in stack.extprocs:
        child.signal(signal.SIGKILL)
        assert child.proc is not None
        child.proc.wait(5)
    clear_engine_logs(stack)
    for headers in ({"authorization": f"Bearer {acme_key}"}, {}):
        resp = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(), headers)
        assert_contract_error(resp, 503, "policy_unavailable")
    resp = request(f"{stack.url}/v1/models", headers={"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 503, "policy_unavailable")
    assert engine_log(stack) == []  # Envoy passed nothing through unprocessed


def test_dead_pool_is_502_in_contract_shape(fresh_stack: Stack, acme_key: str) -> None:
    for child in fresh_stack.engines.values():
        child.stop()
    resp = request(f"{fresh_stack.url}/v1/chat/completions", "POST", chat_body(),
                   {"authorization": f"Bearer {acme_key}"})
    assert_contract_error(resp, 502, "upstream_error")


def _metric(url: str, prefix: str) -> float:
    for line in request(f"{url}/metrics").body.decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(prefix)


def test_tenants_never_share_a_prefix_cache_salt(stack: Stack, acme_key: str, globex_key: str) -> None:
    """Invariant 10: the same long prompt from two tenants hits the prefix cache only within a tenant."""
    clear_engine_logs(stack)
    prompt = f"{uuid.uuid4().hex} " + "a long shared system prompt about the gateway " * 40
    body = chat_body(content=prompt, max_tokens=1, cache_salt="client-chosen")
    before = {u: _metric(u, "vllm:prefix_cache_hits_total{") for u in stack.engine_urls()}
    for key in [acme_key, globex_key] * 4:  # 4 each over 2 engines: each tenant repeats on some engine
        resp = request(f"{stack.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {key}"})
        assert resp.status == 200
    entries = [e for e in engine_log(stack) if prompt in json.dumps(e["messages"])]
    assert len(entries) == 8
    salts = {e["cache_salt"] for e in entries}
    assert len(salts) == 2 and "client-chosen" not in salts
    # A repeat hits every full 16-token block of the prompt but the last token's.
    tokenized = request(f"{stack.engine_urls()[0]}/tokenize", "POST", {"messages": entries[0]["messages"]})
    n_tokens = tokenized.json()["count"]
    per_repeat = (n_tokens - 1) // 16 * 16
    for url in stack.engine_urls():
        seen: set[str] = set()
        repeats = 0  # requests this engine got after one with the same salt
        for e in (e for e in entries if e["engine"] == url):
            repeats += e["cache_salt"] in seen
            seen.add(e["cache_salt"])
        gained = _metric(url, "vllm:prefix_cache_hits_total{") - before[url]
        # Hits exactly where the same tenant came before; never from the other tenant's blocks.
        assert gained == repeats * per_repeat, (url, gained, repeats, per_repeat)
