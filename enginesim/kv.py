"""Paged KV cache with automatic prefix caching, as vLLM does it.

A full block of prompt tokens is identified by a hash chained over all blocks before it; the first
block's hash also covers the request's `cache_salt`, so requests with different salts never share a
cached block. Freed blocks keep their hash and can be hit again until they are evicted (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None


@dataclass
class BlockTable:
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of the prompt's full blocks


def block_hashes(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    hashes: list[int] = []
    prev: object = ("salt", salt)
    for i in range(len(tokens) // block_size):
        h = hash((prev, tuple(tokens[i * block_size:(i + 1) * block_size])))
        hashes.append(h)
        prev = h
    return hashes


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching  # vLLM's --enable-prefix-caching (on by default in V1)
        self.num_blocks = num_blocks
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self._blocks)  # LRU first
        self._cached: dict[int, Block] = {}
        self.queries_tokens = 0
        self.hit_tokens = 0

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    def lookup_prefix(self, table: BlockTable, prompt_len: int) -> int:
        """Take cached blocks for the longest cached prefix; return the number of hit tokens.
        At least one prompt token is always left to compute, as in vLLM."""
        if not self.prefix_caching:
            return 0
        hits: list[Block] = []
        for h in table.hashes:
            if (len(hits) + 1) * self.block_size >= prompt_len:
                break
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        for b in hits:
            if b.ref_count == 0:
                self._free.pop(b.id, None)
            b.ref_count += 1
        table.blocks.extend(hits)
        return len(hits) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's `POST /reset_prefix_cache` does: only while no
        sequence holds a block (False otherwise, and nothing changes)."""
        if self.used_blocks:
            return False
        for b in self._cached.values():
            b.hash = None
        self._cached.clear()
        return True

    def record_query(self, prompt_len: int, hit_tokens: int) -> None:
        """Count a lookup once its allocation went through (vllm:prefix_cache_queries/hits_total)."""
        self.queries_tokens += prompt_len
        self.hit_tokens += hit_tokens

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table.blocks))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        n = self.blocks_needed(table, num_tokens)
        if n > len(self._free):
            return False
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            if b.hash is not None:  # evict its cached content
                self._cached.pop(b.hash, None)
                b.hash = None
            b.ref_count = 1
            table.blocks.append(b)
        return True

    def commit_full_blocks(self, table: BlockTable, computed_tokens: int) -> None:
        """Register prompt blocks whose tokens are now computed, so later requests can hit them."""
        full = min(computed_tokens // self.block_size, len(table.hashes))
        for i in range(full):
            b = table.blocks[i]
            if b.hash is None and table.hashes[i] not in self._cached:
                b.hash = table.hashes[i]
                self._cached[b.hash] = b

    def free(self, table: BlockTable) -> None:
        # Free in reverse so the tail of a sequence is evicted before its shared prefix.
        for b in reversed(table.blocks):
            b.ref_count -= 1
            if b.ref_count == 0:
                self._free[b.id] = b
        table.blocks.clear()
