"""A route served by an Anthropic-shaped provider, through the real processes (issue 13): the openai
SDK's request reaches the simulated provider as a Messages request with the deployment's key, and
its answer comes back as a chat completion, metered at the provider's prices; a field the adapter
cannot carry is refused (reject) or served and reported (report), never dropped silently."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from extproc.config import load_snapshot
from llmgw.bench.translated import (
    PROVIDER_MODEL,
    PROVIDER_PRICES,
    add_anthropic_route,
    add_route_of,
)
from llmgw.conformance.record import stamp
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_provider, start_stack
from tests.helpers import assert_contract_error, chat_body, request
from tests.promtext import scrape, value

pytestmark = pytest.mark.e2e

MODEL = PROVIDER_MODEL
PROVIDER_KEY = "sk-ant-provider-7c2e9a41"
PRICES = PROVIDER_PRICES
KEY = DEMO_KEYS["acme"]


provider = module_provider("anthropic", MODEL, PROVIDER_KEY, "--max-model-len", "8192")


AZURE_KEY = "azure-key-5b1d0c77"
AZURE_MODEL = "gpt-sim-1"


azure = module_provider("azure", AZURE_MODEL, AZURE_KEY, "--max-model-len", "8192")


def add_azure_route(policy: Path, endpoint: str) -> None:
    """An Azure OpenAI deployment (the openai adapter, kind azure) and a route of it alone."""
    (policy / "azure.key").write_text(AZURE_KEY)
    dep = yaml.safe_load((policy / "deployments/claude-sim.yaml").read_text())
    dep.update(deployment="azure-gpt", served_model=AZURE_MODEL, endpoints=[endpoint], credential_ref="file:azure.key")
    dep["fingerprint"].update(adapter="openai@1", engine="azure-openai@2024-10-21", model_digest="sha256:" + "ef" * 32,
                              adapter_options={"kind": "azure", "deployment": "gpt-prod", "api_version": "2024-10-21"})
    (policy / "deployments/azure-gpt.yaml").write_text(yaml.safe_dump(dep))
    ref = load_snapshot(policy).deployments["azure-gpt"].ref
    add_route_of(policy, "chat-azure", ref, adapter="openai@1")
    stamp(policy, "azure-gpt", datetime.now(UTC).date())


def translated_policy(root: Path, provider: str, azure: str) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    ref = add_anthropic_route(dst, provider.removeprefix("http://"), PROVIDER_KEY)
    add_azure_route(dst, azure.removeprefix("http://"))
    add_route_of(dst, "chat-anthropic-report", ref, "report")
    # The pool first, the provider second: a fallback that crosses API shapes.
    add_route_of(dst, "chat-cross", ref, first=False)
    cross = yaml.safe_load((dst / "routes/chat-cross.yaml").read_text())
    cross["retry"] = {"attempts": 1, "eligible_failures": ["connect_before_send", "unavailable"],
                      "requires": "read_only_or_idempotency_key"}
    (dst / "routes/chat-cross.yaml").write_text(yaml.safe_dump(cross))
    add_route_of(dst, "chat-cross-report", ref, "report", first=False)
    for deployment in ("pool-llama-8b", "claude-sim"):  # under chat-cross's retry policy too
        stamp(dst, deployment, datetime.now(UTC).date())
    return dst


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, provider: str, azure: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("translated")
    s = start_stack(tmp / "state", translated_policy(tmp, provider, azure))
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def clean(provider: str) -> None:
    request(f"{provider}/admin/requests", "DELETE")
    request(f"{provider}/admin/faults", "DELETE")


def received(provider: str) -> list[dict[str, Any]]:
    return list(request(f"{provider}/admin/requests").json())


def chat(stack: Stack, route: str, **extra: Any) -> Any:
    return request(f"{stack.url}/v1/chat/completions", "POST", chat_body(route, max_tokens=6, **extra),
                   headers={"authorization": f"Bearer {KEY}"}, timeout=30)


def test_the_openai_sdk_is_answered_by_the_anthropic_provider(gw: Stack, provider: str) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="chat-anthropic", max_tokens=6, messages=[{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": "hello provider"}])
    out = raw.parse()
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage is not None and 0 < out.usage.completion_tokens <= 6
    assert raw.headers["x-llmgw-deployment"] == "claude-sim"
    (sent,) = received(provider)
    assert sent["status"] == 200 and sent["model"] == MODEL and sent["max_tokens"] == 6
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hello provider"}]}]
    assert sent["api_key_present"] and KEY not in str(sent)  # the deployment's key, never the client's
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    assert entry["price_version"] == PRICES["version"] and entry["usage"]["completion_tokens"] == \
        out.usage.completion_tokens
    expected = (out.usage.prompt_tokens * PRICES["input_per_mtok"]
                + out.usage.completion_tokens * PRICES["output_per_mtok"]) // 1_000_000
    assert abs(entry["charged_micros"] - expected) <= 1


def attempts_through_the_filter(stack: Stack, deployment: str) -> float:
    """Attempts the attempt filter (an ext_proc stream per attempt) has seen for `deployment`."""
    try:
        return value(scrape(stack.metrics_url.removesuffix("/metrics")), "llmgw_attempts_total", deployment=deployment)
    except KeyError:
        return 0.0


def test_a_lone_candidate_is_translated_without_the_attempt_filter(gw: Stack, provider: str) -> None:
    """The decision translates the request and Envoy's Lua filter the answer, JSON or stream
    (extproc/direct.py): no ext_proc message per attempt or per chunk. The provider's key reaches the
    provider and nothing else: no log line, no ledger entry."""
    before = attempts_through_the_filter(gw, "claude-sim")
    r = chat(gw, "chat-anthropic")
    assert r.status == 200, r.body
    out = json.loads(r.body)
    assert out["object"] == "chat.completion" and out["model"] == "chat-anthropic"
    assert out["choices"][0]["message"]["content"]
    assert r.headers["content-type"] == "application/json"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    (attempt,) = entry["attempts"]
    assert attempt["deployment"] == "claude-sim" and attempt["status"] == 200 and attempt["count"] == 1
    assert entry["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]
    streamed = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-anthropic", max_tokens=4, stream=True),
                       headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert streamed.status == 200 and streamed.headers["content-type"] == "text/event-stream"
    events = [e.removeprefix("data: ") for e in streamed.body.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "chat-anthropic" for c in chunks)
    assert "usage" not in str(chunks)  # asked for on the client's behalf, withheld from it
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    stream_entry = ledger_of(gw, streamed.headers["x-request-id"], "acme")
    assert text and stream_entry["usage"]["completion_tokens"] == 4 and stream_entry["termination"] == "complete"
    assert [s["path"] for s in received(provider)] == ["/v1/messages"] * 2
    time.sleep(1)  # long enough for the metric to show an attempt, had there been one
    assert attempts_through_the_filter(gw, "claude-sim") == before
    logs = "".join(f.read_text(errors="replace") for f in gw.logs.glob("*.log"))
    assert PROVIDER_KEY not in logs and PROVIDER_KEY not in json.dumps(entry) + json.dumps(stream_entry)


def test_a_transformed_field_is_carried_and_reported(gw: Stack, provider: str) -> None:
    r = chat(gw, "chat-anthropic", stop=["zzz-never"], temperature=1.5)
    assert r.status == 200, r.body
    assert r.headers["x-llmgw-translation-loss"] == "stop (transformed), temperature (transformed)"
    (sent,) = received(provider)
    assert sent["status"] == 200


def test_an_unsupported_field_is_refused_under_reject_and_never_sent(gw: Stack, provider: str) -> None:
    r = chat(gw, "chat-anthropic", seed=7)
    err = assert_contract_error(r, 400, "unsupported_field")
    assert err["param"] == "seed"
    assert received(provider) == []


def test_an_unsupported_field_is_served_and_reported_under_report(gw: Stack, provider: str) -> None:
    r = chat(gw, "chat-anthropic-report", seed=7, logprobs=True)
    assert r.status == 200, r.body
    assert r.headers["x-llmgw-translation-loss"] == "seed (unsupported), logprobs (unsupported)"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    (attempt,) = entry["attempts"]
    assert attempt["deployment"] == "claude-sim"
    assert attempt["translation_loss"] == ["seed (unsupported)", "logprobs (unsupported)"]
    (sent,) = received(provider)
    assert "seed" not in str(sent)


def test_the_providers_overload_is_the_contracts_error(gw: Stack, provider: str) -> None:
    request(f"{provider}/admin/faults", "POST", {"fault": "status=529", "count": 1})
    r = chat(gw, "chat-anthropic")
    assert_contract_error(r, 502, "upstream_error")


@pytest.mark.parametrize("stream", [False, True])
def test_envoys_own_reply_reaches_a_chat_caller_in_the_contracts_shape(gw: Stack, provider: str,
                                                                      stream: bool) -> None:
    """The Lua answer filter sets the provider's path (/v1/messages) on a chat completion; Envoy's own
    reply (here its timeout) must still be the contract's error, not the Anthropic door's (issue 27:
    the renderer chose the door's shape by that rewritten path)."""
    request(f"{provider}/admin/faults", "POST", {"fault": "delay_ms=2000", "count": 1})
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-anthropic", max_tokens=6, stream=stream),
                headers={"authorization": f"Bearer {KEY}", "x-llmgw-deadline-ms": "300"}, timeout=30)
    assert_contract_error(r, 504, "deadline_exceeded")  # {"error": {...}} alone: no Anthropic envelope


def test_a_stream_from_the_provider_reaches_the_sdk_as_chat_chunks_and_is_metered(gw: Stack, provider: str) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="chat-anthropic", max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream from the provider"}])
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    (sent,) = received(provider)
    assert sent["stream"] is True and sent["status"] == 200
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    assert entry["termination"] == "complete" and entry["usage"]["completion_tokens"] == 6
    assert entry["price_version"] == PRICES["version"]


def test_a_stream_is_metered_even_when_the_client_did_not_ask_for_usage(gw: Stack) -> None:
    r = chat(gw, "chat-anthropic", stream=True)
    assert r.status == 200 and b'"usage"' not in r.body and r.body.rstrip().endswith(b"data: [DONE]")
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["usage"]["completion_tokens"] == 6 and entry["settlement"] == "actual"


def test_chunks_that_complete_no_event_never_end_the_clients_stream(gw: Stack, provider: str) -> None:
    """A provider's chunk may hold only a ping, a block's end or half an event: its translation is
    empty, and an empty chunk would read as the stream's end to Envoy's stream guard (before the fix,
    about 1 stream in 13 ended `unfinished` or leaked the withheld usage chunk; most often on a new
    upstream connection, so each stream here follows an error answer that closes the last one)."""
    for _ in range(40):
        request(f"{provider}/admin/faults", "POST", {"fault": "status=529", "count": 1})
        chat(gw, "chat-anthropic")
        r = chat(gw, "chat-anthropic", stream=True)
        assert r.body.rstrip().endswith(b"data: [DONE]") and b'"usage"' not in r.body, r.body[-300:]


def test_a_provider_error_mid_stream_interrupts_the_clients_stream(gw: Stack, provider: str) -> None:
    request(f"{provider}/admin/faults", "POST", {"fault": "error_after=2", "count": 1})
    r = chat(gw, "chat-anthropic", stream=True)
    assert r.status == 200
    # a chunk that completes no Anthropic event (a ping, a block's end) reaches the client as an SSE comment
    events = [e for e in r.body.decode().split("\n\n") if e.strip() and not e.startswith(":")]
    assert '"stream_interrupted"' in events[-1] and "[DONE]" not in r.body.decode()
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]
                if json.loads(e[6:]).get("choices")]
    assert len([c for c in contents if c]) == 2  # the two deltas sent before the provider's error
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] != "complete"


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_count_no_provider_gives_breaks_the_answer(gw: Stack, provider: str, stream: bool) -> None:
    """The provider reports an output count that is no count: the Lua filter's translation cannot
    carry it - a JSON answer is the contract's 502, a stream ends with `stream_interrupted` - and
    nothing of it is charged as a count."""
    for count in ("-7", "2.5", '"7"'):
        request(f"{provider}/admin/faults", "POST", {"fault": f"usage={count}", "count": 1})
        r = chat(gw, "chat-anthropic", stream=stream)
        if stream:
            events = [e for e in r.body.decode().split("\n\n") if e.startswith("data: ")]
            assert json.loads(events[-1][6:])["error"]["code"] == "stream_interrupted", (count, events[-2:])
            assert "[DONE]" not in r.body.decode()
        else:
            assert_contract_error(r, 502, "upstream_error")
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        assert entry["termination"] != "complete" and entry["usage_source"] != "reported", (count, entry)
        if not stream:  # the provider answered 200: its work is charged in full, never released
            assert entry["settlement"] == "ambiguous" and entry["charged_micros"] == entry["reserved_micros"] > 0, entry


def test_a_provider_stream_that_ends_early_ends_with_the_contracts_interruption(gw: Stack, provider: str) -> None:
    """The provider ends its answer cleanly, but before `message_stop`: the Lua filter's interruption
    rides on the stream's last frame and still reaches the client, and nothing says it finished."""
    request(f"{provider}/admin/faults", "POST", {"fault": "end_after=3", "count": 1})
    r = chat(gw, "chat-anthropic", stream=True)
    assert r.status == 200
    events = [e for e in r.body.decode().split("\n\n") if e.strip() and not e.startswith(":")]
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "stream_interrupted", events[-3:]
    assert "[DONE]" not in r.body.decode() and '"finish_reason":"stop"' not in r.body.decode()
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "stream_interrupted", entry


def test_the_pool_failing_before_its_first_byte_falls_back_across_shapes(gw: Stack, provider: str) -> None:
    for url in gw.engine_urls():
        request(f"{url}/admin/faults", "POST", {"fault": "status=503", "count": 1})
    try:
        r = chat(gw, "chat-cross", content="cross-shape fallback")
    finally:
        for url in gw.engine_urls():
            request(f"{url}/admin/faults", "DELETE")
    assert r.status == 200, r.body
    assert (r.headers["x-llmgw-attempts"], r.headers["x-llmgw-deployment"]) == ("2", "claude-sim")
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["content"]
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    first, second = entry["attempts"]
    assert (first["deployment"], first["status"], first["kind"]) == ("pool-llama-8b", 503, "first")
    assert (second["deployment"], second["kind"], second["adapter"]) == ("claude-sim", "model_fallback", "anthropic@1")
    # The provider's own request id (its `request-id` header), recorded by the attempt filter; the
    # answer's id and its finish reason as the provider wrote it join the last attempt.
    assert second["upstream_request_id"].startswith("req_") and "upstream_request_id" not in first
    assert second["upstream_id"] and second["native_finish_reason"] in ("end_turn", "max_tokens")
    usage = entry["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    expected = ((usage["prompt_tokens"] - cached) * PRICES["input_per_mtok"] + cached * PRICES["cached_input_per_mtok"]
                + usage["completion_tokens"] * PRICES["output_per_mtok"]) // 1_000_000
    assert entry["price_version"] == PRICES["version"] and abs(entry["charged_micros"] - expected) <= 1


def test_a_field_the_provider_cannot_carry_keeps_the_fallback_to_the_pool(gw: Stack, provider: str) -> None:
    """Invariant 13: under reject, a candidate that would lose a field the primary carries is not
    policy-equivalent, so it is not in the plan: the pool answers (its retry, or its 503), never the
    provider."""
    for url in gw.engine_urls():
        request(f"{url}/admin/faults", "POST", {"fault": "status=503", "count": 1})
    try:
        r = chat(gw, "chat-cross", content="seeded", seed=11)
    finally:
        for url in gw.engine_urls():
            request(f"{url}/admin/faults", "DELETE")
    assert received(provider) == []
    assert r.status == 502 or r.headers.get("x-llmgw-deployment") == "pool-llama-8b", (r.status, r.headers)


def test_a_stream_the_provider_refuses_is_the_contracts_error(gw: Stack, provider: str) -> None:
    request(f"{provider}/admin/faults", "POST", {"fault": "status=529", "count": 1})
    r = chat(gw, "chat-anthropic", stream=True)
    assert_contract_error(r, 502, "upstream_error")


def test_an_azure_deployment_gets_its_path_and_key_and_only_what_it_honours(gw: Stack, azure: str) -> None:
    request(f"{azure}/admin/requests", "DELETE")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model="chat-azure", max_tokens=5,
                                         messages=[{"role": "user", "content": "hello azure"}])
    assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="chat-azure", max_tokens=5, stream=True,
                                                 messages=[{"role": "user", "content": "stream azure"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logged = received(azure)
    assert [e["path"] for e in logged] == ["/openai/deployments/gpt-prod/chat/completions?api-version=2024-10-21"] * 2
    assert all(e["api_key_present"] and not e["authorization_present"] and e["model"] == AZURE_MODEL
               and e["cache_salt"] is None for e in logged)  # the pool's prefix-cache salt is not sent
    assert KEY not in str(logged) and AZURE_KEY not in str(logged)
    refused = chat(gw, "chat-azure", top_k=5)  # a vLLM sampling field Azure does not honour
    assert assert_contract_error(refused, 400, "unsupported_field")["param"] == "top_k"
    assert len(received(azure)) == 2


def test_a_doors_caller_sees_the_loss_named_as_it_wrote_it(gw: Stack, provider: str) -> None:
    """Under `report`, a front door's caller reads what was lost in its own field names (the Gemini
    door's `seed` is `generationConfig.seed`), in the header and the ledger."""
    body = {"contents": [{"role": "user", "parts": [{"text": "door loss"}]}],
            "generationConfig": {"maxOutputTokens": 3, "seed": 7}}
    r = request(f"{gw.url}/v1beta/models/chat-anthropic-report:generateContent", "POST", body,
                {"x-goog-api-key": DEMO_KEYS["acme"]})
    assert r.status == 200, r.body
    assert r.headers["x-llmgw-translation-loss"] == "generationConfig.seed (unsupported)"
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["attempts"][-1]["translation_loss"] == ["generationConfig.seed (unsupported)"]


def test_a_doors_own_field_is_dropped_and_reported_where_the_plan_may_try_another_shape(gw: Stack) -> None:
    """Under `report`, a plan that may try the pool first serves the request without the Anthropic
    door's own `service_tier` and says so for the candidate that answered."""
    body = {"model": "chat-cross-report", "max_tokens": 3, "service_tier": "auto",
            "messages": [{"role": "user", "content": "tier report"}]}
    r = request(f"{gw.url}/v1/messages", "POST", body, {"x-api-key": DEMO_KEYS["acme"]})
    assert r.status == 200, r.body
    assert r.headers["x-llmgw-deployment"] == "pool-llama-8b"
    assert "service_tier (unsupported)" in r.headers["x-llmgw-translation-loss"]
