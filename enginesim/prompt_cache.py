"""A provider's prompt cache as it bills it (Anthropic's `cache_control`, Bedrock's `cachePoint`): the
prompt through the request's last breakpoint is one cache entry, keyed by its exact tokens. A request
whose prefix is cached reads it (`cache_read`), and its entry lives on for another TTL; one whose prefix
is not writes it (`cache_write`, at the TTL's rate). The engine's own prefix cache (enginesim/kv.py)
still decides how long the prefill takes: this decides only what the provider bills."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from enginesim.tokenizer import GENERATION_PROMPT_TOKENS, encode

TTL_S = {"5m": 300.0, "1h": 3600.0}


def prefix_through(prompt: Sequence[int], after: str) -> int:
    """The prompt's tokens through a breakpoint: the prompt less the text that follows the breakpoint
    and the chat template's generation prompt."""
    return max(0, len(prompt) - len(encode(after)) - GENERATION_PROMPT_TOKENS)


@dataclass(frozen=True)
class CacheUse:
    read: int = 0  # prompt tokens served from the cache
    written: int = 0  # prompt tokens written to it, at the 5-minute rate
    written_1h: int = 0  # ... at the 1-hour rate


@dataclass
class PromptCache:
    clock: Callable[[], float] = time.monotonic
    entries: dict[str, float] = field(default_factory=dict)  # prefix digest -> when it expires

    def use(self, prompt: Sequence[int], prefix: int, ttl: str = "5m") -> CacheUse:
        """What a request whose first `prefix` tokens are marked for caching reads and writes."""
        if prefix <= 0:
            return CacheUse()
        now = self.clock()
        key = hashlib.sha256(",".join(map(str, prompt[:prefix])).encode()).hexdigest()
        hit = self.entries.get(key, 0.0) > now
        self.entries[key] = max(self.entries.get(key, 0.0), now + TTL_S.get(ttl, TTL_S["5m"]))
        if hit:
            return CacheUse(read=prefix)
        return CacheUse(written_1h=prefix) if ttl == "1h" else CacheUse(written=prefix)
