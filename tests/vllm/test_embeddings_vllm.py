"""Embeddings through the gateway to vLLM's pooling runner (`--runner pooling --convert embed` on the
generated tiny model): the openai SDK as its users write it, vLLM's own vectors and token counts, the
ledger charging what vLLM counted."""

from __future__ import annotations

import math

import openai

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of


def test_embeddings_from_a_real_pooling_runner(vllm_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{vllm_stack.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0, timeout=120)
    raw = client.embeddings.with_raw_response.create(model="embed-default", input=["hello world", "a second input"])
    r = raw.parse()
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == len(r.data[1].embedding) > 1
    assert all(abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-3 for d in r.data)  # the pooler normalises
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    entry = ledger_of(vllm_stack, raw.headers["x-request-id"], "acme")
    assert entry["operation"] == "embeddings" and entry["settlement"] == "actual"
    assert entry["charged_tokens"] == r.usage.prompt_tokens <= entry["reserved_tokens"]
    again = client.embeddings.create(model="embed-default", input="hello world", encoding_format="float")
    assert max(abs(a - b) for a, b in zip(again.data[0].embedding, r.data[0].embedding, strict=True)) < 1e-2
