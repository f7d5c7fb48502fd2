"""An upstream that refuses a request the gateway admitted says why, and the caller reads it (issue 44):
through real Envoy, each shape's simulated upstream refuses what its real API refuses - vLLM
`top_logprobs` without `logprobs`, Anthropic a fifth cache_control block, Gemini a safety threshold it
does not know - and the caller's SDK raises its own error with the upstream's reason after the
gateway's words, in its door's shape; the ledger's attempt records the reason and its status, and
nothing is charged. The filter's own logic (redaction, bounds, shapes of error bodies) is
tests/lua/test_lua_upstream_status.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.helpers import request

pytestmark = pytest.mark.e2e

WORDS = "the upstream rejected the request as invalid: "
VLLM_REASON = "when using `top_logprobs`, `logprobs` must be set to true."
ANTHROPIC_REASON = "A maximum of 4 blocks with cache_control may be provided. Found 5."
GEMINI_REASON = "Invalid value at 'safety_settings[0].threshold'"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("refusals"), simulate_providers=True)
    yield s
    s.stop()


def refused_and_ledgered(stack: Stack, rid: str, reason: str, deployment: str) -> None:
    """The ledger's entry: the caller's 400, the upstream's own status and reason on its attempt, no charge."""
    entry = ledger_of(stack, rid, "acme")
    assert entry["status"] == 400 and entry["charged_micros"] == 0, entry
    attempt = entry["attempts"][-1]
    assert (attempt["deployment"], attempt["status"], attempt["upstream_message"]) == (deployment, 400, reason)


@pytest.mark.parametrize(("stream", "idempotent"), [(False, False), (True, False), (False, True)])
def test_a_pool_engines_reason_reaches_the_openai_sdk(up: Stack, stream: bool, idempotent: bool) -> None:
    """A JSON answer (settled from the access log), a stream, an idempotent request (the meter settles it)."""
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)
    key = {"idempotency-key": f"refused-{stream}"} if idempotent else {}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="chat-default", stream=stream, top_logprobs=3, extra_headers=key,
                                       messages=[{"role": "user", "content": "how sure are you?"}])
    error: Any = refused.value
    assert error.code == "invalid_request" and error.body["message"] == WORDS + VLLM_REASON
    refused_and_ledgered(up, error.response.headers["x-request-id"], VLLM_REASON, "pool-llama-8b")


def test_an_anthropic_providers_reason_reaches_the_anthropic_sdk(up: Stack) -> None:
    client = anthropic.Anthropic(base_url=up.url, api_key=DEMO_KEYS["acme"], max_retries=0)
    marked: Any = {"type": "ephemeral"}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="chat-anthropic", max_tokens=20,
            system=[{"type": "text", "text": f"rule {i}", "cache_control": marked} for i in range(3)],
            messages=[{"role": "user", "content": [{"type": "text", "text": f"part {i}", "cache_control": marked}
                                                   for i in range(2)]}])
    error: Any = refused.value
    assert error.body["type"] == "error" and error.body["error"]["message"] == WORDS + ANTHROPIC_REASON
    refused_and_ledgered(up, error.response.headers["x-request-id"], ANTHROPIC_REASON, "demo-anthropic")


def test_a_gemini_providers_reason_reaches_a_gemini_caller(up: Stack) -> None:
    r = request(f"{up.url}/v1beta/models/chat-gemini:generateContent", "POST", {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_SOMETIMES"}]},
        {"x-goog-api-key": DEMO_KEYS["acme"]})
    error = r.json()["error"]
    assert r.status == 400 and (error["code"], error["status"]) == (400, "INVALID_ARGUMENT")
    assert error["message"] == WORDS + GEMINI_REASON
    refused_and_ledgered(up, r.headers["x-request-id"], GEMINI_REASON, "demo-gemini")
