"""A reasoning model in the pool (vLLM started with a reasoning parser: the simulator's
`--reasoning-parser`): its reasoning reaches every door's caller in that door's shape, JSON and
stream - OpenAI's `reasoning`, Anthropic's thinking block (unsigned: no provider signed it), Gemini's
thought parts - before the answer, through the real Envoy with each SDK as its users write it."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
ASK = [{"role": "user", "content": "think first"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("reasoning"), engine_args=("--reasoning-parser", "qwen3"))
    yield s
    s.stop()


def test_openai_reasoning_comes_back_beside_the_answer(thinking: Stack) -> None:
    c = openai.OpenAI(base_url=f"{thinking.url}/v1", api_key=KEY, max_retries=0)
    raw = c.chat.completions.with_raw_response.create(model="chat-default", max_tokens=200, messages=ASK)
    m = raw.parse().choices[0].message
    assert getattr(m, "reasoning", None) and m.content
    # Reasoning is output: charged as the engine counted it, thoughts included.
    usage = raw.parse().usage
    assert usage is not None
    assert ledger_of(thinking, raw.headers["x-request-id"], "acme")["usage"]["completion_tokens"] == \
        usage.completion_tokens > len(m.content.split())
    chunks = list(c.chat.completions.create(model="chat-default", max_tokens=200, messages=ASK, stream=True))
    kinds = ["reasoning" if getattr(ch.choices[0].delta, "reasoning", None) else "content"
             for ch in chunks if ch.choices and (ch.choices[0].delta.content or
                                                 getattr(ch.choices[0].delta, "reasoning", None))]
    assert kinds[0] == "reasoning" and kinds[-1] == "content" and kinds == sorted(kinds, key=lambda k: k != "reasoning")


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_callers_get_a_thinking_block_first(thinking: Stack, stream: bool) -> None:
    c = anthropic.Anthropic(base_url=thinking.url, api_key=KEY, max_retries=0)
    if stream:
        with c.messages.stream(model="chat-default", max_tokens=200, messages=ASK) as s:  # type: ignore[arg-type]
            kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
            m = s.get_final_message()
        assert kinds[0] == "thinking_delta" and "signature_delta" not in kinds and kinds[-1] == "text_delta"
    else:
        m = c.messages.create(model="chat-default", max_tokens=200, messages=ASK)  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["thinking", "text"]
    block = m.content[0]
    assert isinstance(block, anthropic.types.ThinkingBlock) and block.thinking and block.signature == ""


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_callers_get_thought_parts_first(thinking: Stack, stream: bool) -> None:
    c = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=thinking.url))
    config = types.GenerateContentConfig(max_output_tokens=200)
    if stream:
        parts = [p for r in c.models.generate_content_stream(model="chat-default", contents="think first",
                                                               config=config)
                 for p in ((r.candidates or [None])[0].content.parts or [])  # type: ignore[union-attr]
                 if p.text]
    else:
        r = c.models.generate_content(model="chat-default", contents="think first", config=config)
        parts = list(r.candidates[0].content.parts or ())  # type: ignore[index, union-attr]
    assert parts[0].thought and any(not p.thought and p.text for p in parts)
    assert [bool(p.thought) for p in parts] == sorted((bool(p.thought) for p in parts), reverse=True)
