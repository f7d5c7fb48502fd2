"""The sweeper: a reservation whose lease expired (the gateway lost track of it: a crash, a lost
access log) is charged in full and marked ambiguous, so a crashed gateway never frees money it may
have spent."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from extproc.settlement.observe import swept
from extproc.settlement.settler import log
from extproc.slices import NOT_PROCESSED, lost_facts
from extproc.store import SLICE_MEMBER, Settlement, SliceCommit, Store, StoreUnavailable


class Sweeper:
    """Charges expired leases in full, marked ambiguous. Every worker sweeps; settlement is idempotent."""

    def __init__(self, store: Store, tenants: Callable[[], Iterable[str]], interval_s: float = 1.0):
        self.store, self.tenants, self.interval_s = store, tenants, interval_s

    async def sweep_once(self, now_ms: int | None = None) -> int:
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        settled = 0
        for tenant in self.tenants():
            for rid in await self.store.expired_leases(tenant, now_ms):
                if rid.startswith(SLICE_MEMBER):  # a slice whose worker died holding it
                    settled += await self.end_slice(tenant, rid.removeprefix(SLICE_MEMBER).rsplit(":", 1)[0])
                    continue
                held = await self.store.reservation(tenant, rid)
                if not held:
                    continue  # settled since the lease was read
                outcome: dict[str, Any] = {"termination": "unknown", "settlement": "ambiguous", "usage": None,
                                           "attempts": [], "note": "lease expired before settlement: charged in full"}
                if await self.store.settle(Settlement(tenant, rid, outcome, hint=held.get("hint", ""))) is not None:
                    settled += 1
                    log.warning("request %s (%s): lease expired; charged in full as ambiguous", rid, tenant)
                    swept(rid, orjson.loads(held.get("record") or "{}"), outcome)()
        return settled

    async def end_slice(self, tenant: str, slice_id: str) -> int:
        """A slice expired unended (its worker died holding it): the outcomes that came for its unwritten
        admissions are settled, what it held unused goes back (extproc/slices.py). Returns how many it
        settled."""
        held = await self.store.slice_held(tenant, slice_id)
        if not held:
            return 0  # ended since its permits were read
        keys = orjson.loads(held.get("keys") or "{}")
        (out,) = await self.store.commit_slices([SliceCommit(
            tenant, slice_id, keys.get("b", []), [tuple(r) for r in keys.get("r", [])], [], True, NOT_PROCESSED,
            lost_facts(tenant))])
        if isinstance(out, BaseException):
            raise out
        log.warning("slice %s (%s) expired with its worker: ended, %d outcome(s) settled", slice_id, tenant,
                    int(out[1]))
        return int(out[1])

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep_once()
            except StoreUnavailable:
                pass  # the next round tries again; nothing is lost, leases stay in the store
            except Exception:
                log.exception("sweeper round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
