"""Admission control: overload becomes fast, fair refusals instead of every request slowing together.

Two capacities are held before dispatch, both in the store, so every worker and replica sees the same:

- **A pool's slots.** A pool with `admission` takes at most its bound of requests at once: `max_in_flight`
  (the ceiling), shrunk to what its engines run plus `waiting_per_engine` each while they report a queue
  of their own past that, or a KV cache past `kv_usage_limit` (the picker's readings: the engines' own
  signals). A slot is a lease in the pool's sorted set (`llmgw:{admit:<pool>}:slots`), taken by one
  script and given back at settlement (the reservation's hint names it); a crashed gateway's slots end
  with their leases.
- **A hosted deployment's provider quota** (`provider_quota`: requests and tokens per minute, as agreed)
  and each tenant's share of it: token buckets of a minute's size refilled continuously, the way
  providers count, all charged by one script or none; the token bound is charged, and what the
  request did not use of it is given back at settlement (extproc/provider_quota.py, with its slices).

The plan's candidates are tried in order: the first with room is where the request goes (`skipped=` in
the ledger names those passed over), before any byte left. None with room: the request waits for the
first pooled candidate in this worker's queue for that pool, at most its class's `queue_ttl_ms` and what
is left of its deadline, then gets 429 `overloaded` with Retry-After. A plan of hosted candidates only,
their quotas spent, gets the 429 at once, Retry-After when the first bucket has room again.

The queue is one per pool, in the store, for every worker and replica: the highest priority first (the
request class's `priority`) and, within a priority, the tenants by weight (start-time fair queuing: a
tenant's next request starts 1/weight after its last, and a tenant that returns after idling starts at
the priority's clock, so idling banks no credit). With k slots free the first k waiters are admitted.
Each worker holds its own waiters' coroutines and asks the store for the first of them every POLL_S
(the others are behind it in the same order). A waiter whose client goes away leaves the queue at once
(its stream is cancelled); one whose worker died leaves when its wait would have ended.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.config.schema import Deployment, GatewayConfig, PoolAdmission
from extproc.contract import ErrorCode, GatewayError
from extproc.picker import EngineLoad
from extproc.provider_quota import ProviderQuotas
from extproc.single_flight import SingleFlight
from extproc.slices import SHARE  # a worker's slice of a pool's slots: at most 1/SHARE of those free
from extproc.store import SLICE_MEMBER, RateCharge, Store, StoreUnavailable, in_background, slots_key

log = logging.getLogger("llmgw.admission")

POLL_S = 0.02  # how often a worker with waiters asks the store whether the first of them is admitted
MEMBERS_KEPT_S = 30.0  # how long a request's slice member is known after its slice ended (its decision ends first)
RATE_WINDOW_S = 10.0  # admissions over this window estimate how soon a slot frees (Retry-After)


def derived_limit(ceiling: PoolAdmission, loads: Sequence[EngineLoad]) -> int:
    """The pool's bound from its engines' own signals, under the configured ceiling: while they queue
    beyond what it tolerates, or their KV cache is nearly full, only what they run (plus the tolerated
    queue) - a queue forms in the gateway, where priority and fairness can order it, not in the engines.
    No fresh reading: the ceiling alone."""
    if not loads:
        return ceiling.max_in_flight
    tolerated = ceiling.waiting_per_engine * len(loads)
    waiting = sum(ld.waiting for ld in loads)
    running = sum(ld.running for ld in loads)
    kv = sum(ld.kv_usage for ld in loads) / len(loads)
    if waiting > tolerated or kv >= ceiling.kv_usage_limit:
        return max(1, min(ceiling.max_in_flight, math.floor(running + tolerated)))
    return ceiling.max_in_flight


@dataclass(eq=False)
class Waiter:
    rid: str
    tenant: str
    weight: float
    priority: int
    lease_until_ms: int
    enqueued: float  # monotonic
    future: asyncio.Future[None]
    start: float = 0.0  # its start tag in the pool's queue (the store's)

    @classmethod
    def of(cls, gw: GatewayConfig, request_class: str, tenant: str, rid: str, lease_until_ms: int) -> Waiter:
        """A request asking now: its class's priority, its tenant's weight."""
        rc = gw.request_classes.get(request_class)
        weight = gw.tenants[tenant].weight if tenant in gw.tenants else 1.0
        return cls(rid, tenant, weight, rc.priority if rc is not None else 0, lease_until_ms, time.monotonic(),
                   asyncio.get_running_loop().create_future())

    def place(self) -> tuple[int, float]:
        """Its place in the pool's queue: the store's order (priority, then start tag)."""
        return -self.priority, self.start


class PoolGate:
    """One pool's admission at this worker: the fast path, and the task that asks the store for the
    first of this worker's waiters until they are admitted or gone."""

    def __init__(self, pool: str, settings: PoolAdmission, store: Store,
                 loads: Callable[[], Sequence[EngineLoad]] = tuple):
        self.pool, self.settings, self.store = pool, settings, store
        self.waiters: list[Waiter] = []  # this worker's, in the queue's order
        # The pool's fresh engine readings, read at every ask: a waiter's poll sees the engines' queue
        # drain as it drains (a bound kept from the last decision held a lone waiter to its TTL and shed
        # it while the engines had room again: the bulkhead test in the clean-clone CI).
        self.loads = loads
        self._task: asyncio.Task[None] | None = None
        self._admitted: deque[float] = deque()  # monotonic times of recent admissions (Retry-After)
        # Slices of the pool's slots (gateway.yaml store.slice_requests, slice_ms; set by AdmissionControl):
        # with room and nobody waiting, a worker takes a few slots at once and admits from them locally.
        self.slicing = (0, 0)
        self._slice: SlotSlice | None = None
        self._taking = SingleFlight()
        self._no_room_until_ms = 0
        self._members: dict[str, str] = {}  # request id -> the slice member it holds as its slot
        self._ids = (f"{uuid.uuid4().hex[:12]}.{n}" for n in itertools.count(1))

    def limit(self) -> int:
        return derived_limit(self.settings, self.loads())

    def _note_admitted(self) -> None:
        now = time.monotonic()
        self._admitted.append(now)
        while self._admitted and now - self._admitted[0] > RATE_WINDOW_S:
            self._admitted.popleft()

    def retry_after_s(self) -> int:
        """When a refused request may find room: the waiters here over the recent admission rate."""
        now = time.monotonic()
        recent = sum(1 for t in self._admitted if now - t <= RATE_WINDOW_S)
        if not recent:
            return 1
        return max(1, min(60, math.ceil((len(self.waiters) + 1) / (recent / RATE_WINDOW_S))))

    async def ask(self, w: Waiter, wait_until_ms: int = 0) -> tuple[bool, float | None]:
        """The store's answer for this request: admitted, or waiting (its start tag), or neither. A
        request that may not wait is admitted from this worker's slice of the pool's slots when there is
        one (or one can be taken), without its own round trip."""
        if wait_until_ms == 0 and self.slicing[0] >= 2 and await self._from_slice(w):
            return True, None
        ok, start = await self.store.admit(self.pool, w.rid, int(time.time() * 1000), w.lease_until_ms, self.limit(),
                                           w.priority, w.tenant, w.weight, wait_until_ms)
        if ok:
            self._note_admitted()
        return ok, start

    def give_back(self, rid: str) -> None:
        """A slot granted to a request that will not use it, returned in the background (a lost return
        ends with the slot's lease)."""
        in_background(self.store.release_slot(self.pool, self._members.pop(rid, rid)))

    def slot_hint(self, rid: str) -> dict[str, str | None]:
        """The slot a request holds, as its hint names it for settlement to give back: the pool's slots,
        and the slice member when it was admitted from a slice."""
        return {"a": slots_key(self.pool), "m": self._members.get(rid)}

    def slot_now(self, w: Waiter) -> bool:
        """A slot for `w` from this worker's open slice, without waiting for anything (False: none fits)."""
        s = self._slice
        if self.slicing[0] < 2 or s is None:
            return False
        # The engines' signals shrank the pool's bound since the slice was taken: what it still holds goes
        # back, and the request asks the store under the bound as it is now.
        limit = self.limit()
        if int(time.time() * 1000) >= s.admit_until_ms or s.used >= s.size or limit < s.limit:
            self._end(s)
            return False
        if w.lease_until_ms > s.expires_ms:
            return False  # a longer lease than the slice's members end at
        s.used += 1
        self._members[w.rid] = f"{SLICE_MEMBER}{s.id}:{s.used}"
        s.rids.append(w.rid)
        self._note_admitted()
        return True

    async def _from_slice(self, w: Waiter) -> bool:
        """A slot for `w` from this worker's slice, taking a slice when there is none (False: ask the
        store for this request alone)."""
        now = int(time.time() * 1000)
        limit = self.limit()
        for _ in range(2):
            if self.slot_now(w):
                return True
            if self._slice is not None:
                return False  # it is open, and `w` does not fit it (a longer lease)
            if now < self._no_room_until_ms:
                return False
            if await self._taking.joined():  # another request is taking one: share it
                continue
            wanted, slice_ms = self.slicing
            sid, admit_until, expires = next(self._ids), now + slice_ms, w.lease_until_ms + slice_ms
            with self._taking.taking():
                k = await self.store.take_slots(self.pool, sid, now, expires, wanted, limit, SHARE)
            if k < 2:
                self._no_room_until_ms = now + slice_ms
                return False
            self._slice = SlotSlice(sid, k, admit_until, expires, limit)
            asyncio.get_running_loop().call_later(slice_ms / 1000, self._end, self._slice)
        return False

    def _end(self, s: SlotSlice) -> None:
        """A slice's time is up (or it is used up): its unused slots go back now, and its members are
        forgotten once every decision that took one has ended."""
        if s.ended:
            return
        s.ended = True
        if self._slice is s:
            self._slice = None
        in_background(self.store.release_slot(self.pool, *(f"{SLICE_MEMBER}{s.id}:{j}"
                                                         for j in range(s.used + 1, s.size + 1))))
        asyncio.get_running_loop().call_later(MEMBERS_KEPT_S, self._forget, list(s.rids))

    def _forget(self, rids: list[str]) -> None:
        for rid in rids:
            self._members.pop(rid, None)

    def wait(self, w: Waiter) -> bool:
        """Hold a waiter the store queued (False: this worker holds max_queued already)."""
        if len(self.waiters) >= self.settings.max_queued:
            return False
        bisect.insort(self.waiters, w, key=Waiter.place)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._serve())
        return True

    def leave(self, w: Waiter) -> None:
        """It stops waiting: out of this worker's list now, out of the store's queue in the background."""
        if w in self.waiters:
            self.waiters.remove(w)
        in_background(self.store.leave(self.pool, w.rid))  # a lost leave ends with its wait

    async def _serve(self) -> None:
        """While this worker has waiters: ask for the first; admitted, ask for the next at once; not yet,
        ask again after POLL_S."""
        while self.waiters:
            w = self.waiters[0]
            try:
                ok, _ = await self.ask(w)
            except StoreUnavailable as e:
                err = GatewayError(ErrorCode.POLICY_UNAVAILABLE, f"the admission store is unavailable ({e})")
                for gone in self.waiters:
                    if not gone.future.done():
                        gone.future.set_exception(err)
                self.waiters.clear()
                return
            if ok:
                if w in self.waiters:
                    self.waiters.remove(w)
                if w.future.done():  # it left while the script ran: the slot goes back
                    with contextlib.suppress(StoreUnavailable):
                        await self.store.release_slot(self.pool, w.rid)
                else:
                    w.future.set_result(None)
                continue
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class AdmissionControl:
    """This worker's gates, one per pool with `admission`, made as revisions name them."""

    def __init__(self, store: Store, loads: Callable[[str], Sequence[EngineLoad]] | None = None):
        self.store = store
        self._loads = loads  # a pool's fresh engine readings (the picker's), when it runs one
        self.gates: dict[str, PoolGate] = {}
        self.quotas = ProviderQuotas(store)

    def gate(self, pool: str, settings: PoolAdmission | None) -> PoolGate | None:
        if settings is None:
            return None
        gate = self.gates.get(pool)
        if gate is None:
            loads = self._loads
            gate = self.gates[pool] = PoolGate(pool, settings, self.store,
                                               tuple if loads is None else functools.partial(loads, pool))
        gate.settings = settings  # a reload's
        return gate

    def gate_of(self, gw: GatewayConfig, dep: Deployment) -> PoolGate | None:
        """The gate of a candidate's pool, when it is a pool's and the pool has admission."""
        gate = self.gate(dep.pool, gw.pools[dep.pool].admission) if dep.pool is not None else None
        if gate is not None:
            gate.slicing = (gw.store.slice_requests, gw.store.slice_ms)  # a reload's
        return gate

    async def provider_quota(self, gw: GatewayConfig, dep: Deployment, tenant: str,
                             tokens: int) -> tuple[list[RateCharge], int | None]:
        """A request's take of a hosted candidate's provider quota (ProviderQuotas.take): (its charges,
        None), or (its charges, ms until there is room)."""
        self.quotas.slicing = (gw.store.slice_requests, gw.store.slice_ms)  # a reload's
        return await self.quotas.take(dep, tenant, tokens)

    def status(self) -> dict[str, dict[str, int]]:
        """Per pool: its bound now and the requests waiting here (GET /status)."""
        return {p: {"limit": g.limit(), "waiting": len(g.waiters)} for p, g in sorted(self.gates.items())}

    async def stop(self) -> None:
        for g in self.gates.values():
            await g.stop()
        with contextlib.suppress(StoreUnavailable):
            await self.quotas.close()


@dataclass
class SlotSlice:
    """This worker's slice of a pool's slots: members `~<id>:1..size` of the pool's slots, ending at
    `expires_ms` in the store whatever becomes of this worker."""

    id: str
    size: int
    admit_until_ms: int
    expires_ms: int
    limit: int  # the pool's bound when it was taken
    used: int = 0
    rids: list[str] = field(default_factory=list)
    ended: bool = False


@dataclass
class Waiting:
    """A request queued for a slot: what the server awaits between admission and the stages after it
    (its stream tells Envoy first to wait this long: ProcessingResponse.override_message_timeout)."""

    gate: PoolGate
    waiter: Waiter
    wait_s: float
    on_admitted: Callable[[], None]
    on_shed: Callable[[float], GatewayError]

    async def wait(self) -> None:
        """Until admitted (on_admitted runs), or the wait ends (on_shed's error is raised); a cancelled
        waiter (its client gone) leaves at once, its slot given back when it had just been granted."""
        fut = self.waiter.future
        try:
            await asyncio.wait({fut}, timeout=self.wait_s)
        finally:
            self.abandon()
        if fut.cancelled():
            raise self.on_shed(time.monotonic() - self.waiter.enqueued)
        exc = fut.exception()
        if exc is not None:
            raise exc

    def abandon(self) -> None:
        """The wait is over, whatever ended it: a waiter not yet admitted leaves the queue (the task
        serving it gives back a slot granted meanwhile); one just admitted holds its slot (on_admitted)."""
        fut = self.waiter.future
        if not fut.done():
            self.gate.leave(self.waiter)
            fut.cancel()
        elif not fut.cancelled() and fut.exception() is None:
            self.on_admitted()
