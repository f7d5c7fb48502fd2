"""A deterministic stand-in for a byte-level BPE tokenizer and a Llama-3-style chat template.

Properties that matter to the gateway and hold for real byte-level BPE: a text of n UTF-8 bytes never
yields more than n tokens; equal prefixes give equal token prefixes (so prefix caching behaves); the
chat template adds a small fixed number of tokens per message.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from typing import Any

VOCAB_SIZE = 128_256
_PIECE = re.compile(r" ?[A-Za-z]{1,8}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s+", re.UNICODE)

# Per message: <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>  = 4 tokens + content.
TEMPLATE_TOKENS_PER_MESSAGE = 4
TEMPLATE_TOKENS_FIXED = 1  # <|begin_of_text|>
GENERATION_PROMPT_TOKENS = 3  # assistant header


def encode(text: str) -> list[int]:
    return [zlib.crc32(p.encode("utf-8")) % VOCAB_SIZE for p in _PIECE.findall(text)]


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def apply_chat_template(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    """As Llama 3.1's template renders a conversation: the tools' JSON in the first message, each
    message's content, and an assistant's tool calls as `{"name": ..., "parameters": ...}` JSON."""
    tokens = [128000]
    for i, m in enumerate(messages):
        tokens += [128006, zlib.crc32(str(m.get("role", "")).encode()) % VOCAB_SIZE, 128007, 271]
        if i == 0 and tools:
            tokens += encode(json.dumps(tools))
        tokens += encode(_content_text(m.get("content")))
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                tokens += encode(json.dumps({"name": fn.get("name"), "parameters": fn.get("arguments")}))
        tokens.append(128009)
    tokens += [128006, 78191, 128007]
    return tokens


_WORDS = ("the", "model", "gateway", "token", "cache", "request", "policy", "route", "engine", "batch",
          "prefix", "tenant", "budget", "stream", "latency", "deployment", "a", "of", "to", "and", "is",
          "with", "for", "every", "each", "on", "in", "that", "serves", "keeps", "decodes", "reads")


class TextSampler:
    """Deterministic output: the same seed gives the same words and the same natural length."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self.natural_length = self._rng.randint(12, 160)

    def next_piece(self, index: int) -> str:
        word = self._rng.choice(_WORDS)
        return word.capitalize() if index == 0 else " " + word
