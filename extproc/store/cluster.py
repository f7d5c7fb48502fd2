"""The hot path's connection to a Valkey/Redis Cluster: one ScriptPipe per primary, each script sent
to the primary of its first key's slot. Every script's keys share one hash tag (the tenant's), so a
script is never split.

The slot map comes from CLUSTER SHARDS, asked of any node known (the seed first, then every node of the
last map, replicas included: after a failover the seed may be the dead one). It is refreshed on MOVED
(the slot moved: the call is sent once more, to the node named) and after a node stopped answering
(that call fails closed, as with a standalone store; the next one finds the new primary once the
cluster has promoted a replica).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Iterable
from typing import Any

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from extproc.store.errors import StoreUnavailable
from extproc.store.pipe import Redirected, ScriptPipe

REFRESH_BACKOFF_S = 0.1  # during a failover, at most one full round of asking every node per interval


class ClusterPipe:
    def __init__(self, url: str, timeout_s: float, replica_acks: int = 0, replica_ack_timeout_ms: int = 0):
        self.url = urllib.parse.urlsplit(url)
        self.timeout_s = timeout_s
        self.replica_acks, self.replica_ack_timeout_ms = replica_acks, replica_ack_timeout_ms
        seed = f"{self.url.hostname or '127.0.0.1'}:{self.url.port or 6379}"
        self.known: list[str] = [seed]  # every node of the last map (replicas too), seed first
        self._slots: list[str] | None = None  # slot -> its primary's "host:port"
        self._pipes: dict[str, ScriptPipe] = {}
        self._refreshing: asyncio.Lock | None = None
        self._failed_at = -1.0  # when a refresh last found no full map: callers then fail at once

    def _pipe(self, address: str) -> ScriptPipe:
        if address not in self._pipes:
            u = self.url._replace(netloc=(self.url.netloc.rpartition("@")[0] + "@" if "@" in self.url.netloc
                                          else "") + address, path="")
            self._pipes[address] = ScriptPipe(u.geturl(), self.timeout_s, self.replica_acks,
                                              self.replica_ack_timeout_ms)
        return self._pipes[address]

    async def _refresh(self) -> list[str]:
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        stale, loop = self._slots, asyncio.get_running_loop()
        async with self._refreshing:
            if self._slots is not None and self._slots is not stale:
                return self._slots  # another caller refreshed it meanwhile
            if loop.time() - self._failed_at < REFRESH_BACKOFF_S:
                raise StoreUnavailable("store unavailable: cluster slot map being re-established")
            for address in list(self.known):
                try:
                    shards = await self._pipe(address).command("CLUSTER", "SHARDS")
                except StoreUnavailable:
                    continue
                slots, nodes = _slot_map(shards)
                if slots is not None:
                    self._slots, self.known = slots, [*dict.fromkeys([*nodes, *self.known])]
                    return slots
            self._failed_at = loop.time()
            raise StoreUnavailable("store unavailable: no cluster node answered with a full slot map")

    async def _node(self, key: str) -> ScriptPipe:
        slots = self._slots or await self._refresh()
        return self._pipe(slots[key_slot(key.encode())])

    async def load(self, *scripts: str) -> None:
        """Every primary gets the scripts now; a primary first used later (after a failover) loads each
        on its first call, as every ScriptPipe does."""
        slots = self._slots or await self._refresh()
        for address in dict.fromkeys(slots):
            await self._pipe(address).load(*scripts)

    async def evalsha(self, script: str, keys: list[str], args: list[Any]) -> Any:
        for attempt in (1, 2):
            try:
                pipe = await self._node(keys[0])
                return await pipe.evalsha(script, keys, args)
            except Redirected:
                if attempt == 2:
                    raise
                await self._refresh()
            except StoreUnavailable:
                self._slots = None  # the node may be gone: ask the cluster again next time
                raise
        raise AssertionError("unreachable")

    async def evalsha_many(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Calls grouped by primary, each group pipelined on its node's connection, all groups at once;
        a redirected call is sent again alone. Results in the callers' order, a failure as its exception."""
        slots = self._slots or await self._refresh()
        groups: dict[str, list[int]] = {}
        for i, (keys, _) in enumerate(calls):
            groups.setdefault(slots[key_slot(keys[0].encode())], []).append(i)

        async def group(address: str, idx: list[int]) -> list[Any]:
            try:
                return await self._pipe(address).evalsha_many(script, [calls[i] for i in idx])
            except StoreUnavailable as e:
                return [e] * len(idx)

        out: list[Any] = [None] * len(calls)
        results = await asyncio.gather(*(group(a, idx) for a, idx in groups.items()))
        for idx, res in zip(groups.values(), results, strict=True):
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        if any(isinstance(r, StoreUnavailable) and not isinstance(r, Redirected) for r in out):
            self._slots = None  # a node may be gone: ask the cluster again next time
        redirected = [i for i, r in enumerate(out) if isinstance(r, Redirected)]
        if redirected:  # one new map for all of them; each call is then sent once more
            try:
                await self._refresh()
            except StoreUnavailable as e:
                return [e if i in redirected else r for i, r in enumerate(out)]
            for i in redirected:
                try:
                    out[i] = await self.evalsha(script, *calls[i])
                except StoreUnavailable as e:
                    out[i] = e
        return out

    async def close(self) -> None:
        for pipe in self._pipes.values():
            await pipe.close()


def _slot_map(shards: Iterable[Any]) -> tuple[list[str] | None, list[str]]:
    """CLUSTER SHARDS -> (slot -> its healthy primary's address, or None when a slot has none; every
    node's address). Valkey answers flat key/value lists."""
    slots: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    nodes: list[str] = []
    for shard in shards:
        s = _pairs(shard)
        primary = None
        for node in s.get("nodes") or []:
            n = _pairs(node)
            address = f"{n.get('ip') or n.get('endpoint')}:{n.get('port')}"
            nodes.append(address)
            if n.get("role") == "master" and n.get("health") == "online":
                primary = address
        ranges = s.get("slots") or []
        for lo, hi in zip(ranges[0::2], ranges[1::2], strict=True):
            for slot in range(int(lo), int(hi) + 1):
                slots[slot] = primary
    if any(a is None for a in slots):
        return None, nodes
    return slots, nodes  # type: ignore[return-value]


def _pairs(flat: Any) -> dict[str, Any]:
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[0::2], flat[1::2], strict=True))
