"""Slices: a worker admits requests against a slice of a tenant's budgets, quotas and bulkhead that it
took from the store, so the common request reserves without a store round trip.

A slice is taken in one script (scripts.TAKE_SLICE) under the same limits a reservation is checked
against: it holds k requests' worth (each as large as the request that took it) of every budget, quota
and permit the tenant's requests of that kind draw on, k at most `slice_requests` and at most 1/SHARE
of what any limit has left - so slices never overshoot a limit (what they hold is counted as reserved)
and never take its last room (near a limit, requests reserve one by one, exactly). The worker then
admits each request that fits what the slice has left, for at most `slice_ms`, and writes the
admissions behind every `slice_commit_ms` (scripts.COMMIT_SLICE): each becomes a reservation of its own,
as if it had reserved alone, and from then on settles, expires and is swept like one. An outcome that
arrives before its admission is written waits in the slice (scripts.SETTLE), and the admission settles
it. When the slice's time is up, or a request does not fit it, its last commit gives back what it
holds unused.

What a crash can strand: a worker that dies holding a slice leaves what it holds until the slice
expires (its admitting time, plus the longest lease of one of its requests): then the sweeper ends it,
settling the outcomes that came for it (their admission facts died with the worker: the ledger entry
says so) and giving back the rest. Admissions not yet written when the worker died are known only by
their outcomes; a request whose outcome is also lost (its Envoy died with it) is in no ledger. That is at
most `slice_commit_ms` of one worker's admissions, the same kind of bound as the store's own fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from extproc.config.schema import StoreSettings
from extproc.store import (
    SLICE_MEMBER,
    Reservation,
    SliceAdmission,
    SliceCommit,
    Store,
    StoreUnavailable,
    packed,
)

SHARE = 8  # a slice takes at most 1/SHARE of what any limit has left

_log = logging.getLogger("llmgw.slices")

# What a slice's commit writes for a request Envoy answered itself before its admission was written
# (settlement/releases.py `released` makes the same for a reservation of its own).
NOT_PROCESSED = {"termination": "not_processed", "status": 503, "settlement": "released", "usage": None,
                 "attempts": []}


def lost_facts(tenant: str) -> dict[str, Any]:
    """The ledger facts of a request whose admission died with its worker (the script names the request)."""
    return {"tenant": tenant, "request_id": "", "admission": "lost with its worker"}


def account_of(r: Reservation) -> tuple[Any, ...]:
    """What a slice is a slice of: the tenant, every budget and quota a request draws on (with their
    limits), its bulkhead. Requests of one account may share a slice."""
    return (r.tenant, tuple(r.budgets), tuple((q.key, q.ms_per_unit, q.per_token) for q in r.rates),
            r.max_in_flight, r.max_in_flight_tokens)


@dataclass
class Slice:
    """What this worker holds of one account, and the admissions it has not written yet."""

    id: str
    tenant: str
    budgets: tuple[str, ...]
    rates: tuple[tuple[str, float, bool], ...]
    micros: int  # left to admit from
    tokens: int
    requests: int
    size: int  # k, the requests it was taken for
    admit_until_ms: int
    expires_ms: int
    pending: list[SliceAdmission] = field(default_factory=list)
    closed: bool = False  # no more admissions: its next commit is its last

    def admit(self, r: Reservation) -> Reservation | None:
        """`r` admitted from what is left (its hint names the slice), or None when it does not fit."""
        if (self.closed or r.now_ms >= self.admit_until_ms or self.requests < 1 or r.micros > self.micros
                or r.tokens > self.tokens):
            return None
        self.micros -= r.micros
        self.tokens -= r.tokens
        self.requests -= 1
        member = f"{SLICE_MEMBER}{self.id}:{self.size - self.requests}"
        admitted = dataclasses.replace(r, slice_id=self.id)
        self.pending.append(SliceAdmission(r.rid, member, r.micros, r.tokens, r.lease_until_ms, packed(r.record),
                                           admitted.hint))
        return admitted

    def commit(self, now_ms: int) -> SliceCommit | None:
        """What to write now (the pending admissions; the end, once its time is up), or None."""
        if now_ms >= self.admit_until_ms or self.requests < 1:
            self.closed = True
        if not self.pending and not self.closed:
            return None
        batch, self.pending = self.pending, []
        return SliceCommit(self.tenant, self.id, self.budgets, self.rates, batch, self.closed, NOT_PROCESSED,
                           lost_facts(self.tenant))


class SliceBook:
    """This worker's slices, one open per account, and the task that writes their admissions behind."""

    def __init__(self, store: Store):
        self.store = store
        self._ids = (f"{uuid.uuid4().hex[:12]}.{n}" for n in itertools.count(1))
        self._open: dict[tuple[Any, ...], Slice] = {}
        self._ending: list[Slice] = []  # closed, their last commit not yet written
        self._taking: dict[tuple[Any, ...], asyncio.Future[None]] = {}
        # Accounts whose limits had too little room for a slice, and until when none is asked for (their
        # requests reserve one by one, exactly, meanwhile).
        self._no_room: dict[tuple[Any, ...], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._commit_s = 0.02

    async def admit(self, r: Reservation, span_ms: int, settings: StoreSettings) -> Reservation | None:
        """`r` admitted from this worker's slice of its account (taking one when none fits), or None:
        reserve it in the store on its own. `span_ms`: the longest lease of a request that may share the
        slice (it expires no earlier than its last admission's lease). StoreUnavailable when a slice
        was needed and the store did not answer."""
        account = account_of(r)
        for _ in range(2):
            current = self._open.get(account)
            if current is not None and r.lease_until_ms > current.expires_ms:
                return None  # a longer lease than the slice's (another route's): this one reserves alone
            if current is not None:
                if (admitted := current.admit(r)) is not None:
                    return admitted
                current.closed = True
                self._ending.append(self._open.pop(account))
            if self._no_room.get(account, 0) > r.now_ms:
                return None
            if (taking := self._taking.get(account)) is not None:
                await taking  # another request of the account is taking one: share it
                continue
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._taking[account] = done
            try:
                taken = await self._take(r, span_ms, settings)
            finally:
                del self._taking[account]
                done.set_result(None)
            if taken is None:
                self._no_room[account] = r.now_ms + settings.slice_ms
                return None
            self._no_room.pop(account, None)
            self._open[account] = taken
        return None

    async def _take(self, r: Reservation, span_ms: int, settings: StoreSettings) -> Slice | None:
        slice_id = next(self._ids)
        admit_until = r.now_ms + settings.slice_ms
        expires = admit_until + span_ms
        k = await self.store.take_slice(r, slice_id, expires, settings.slice_requests, SHARE)
        if k < 2:
            return None
        self._commit_s = settings.slice_commit_ms / 1000
        self._start()
        return Slice(slice_id, r.tenant, tuple(b.key for b in r.budgets),
                     tuple((q.key, q.ms_per_unit, q.per_token) for q in r.rates),
                     k * r.micros, k * r.tokens, k, k, admit_until, expires)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._open or self._ending:
            await asyncio.sleep(self._commit_s)
            with contextlib.suppress(StoreUnavailable):
                await self.flush()

    async def flush(self, everything: bool = False) -> None:
        """Write every slice's pending admissions, and end the slices whose time is up (all of them when
        `everything`: the worker stops). A write that fails is tried again at the next flush."""
        now_ms = int(time.time() * 1000)
        if everything:
            for s in self._open.values():
                s.closed = True
        slices = [*self._ending, *self._open.values()]
        commits = [(s, c) for s in slices if (c := s.commit(now_ms)) is not None]
        if not commits:
            return
        try:
            results = await self.store.commit_slices([c for _, c in commits])
        except StoreUnavailable:
            results = [StoreUnavailable("store unavailable")] * len(commits)
        failed = 0
        for (s, c), out in zip(commits, results, strict=True):
            if isinstance(out, BaseException):  # written next time, in order, ahead of newer ones
                s.pending[:0] = c.admissions
                failed += 1
            elif c.final:
                self._forget(s)
        if failed:
            _log.warning("%d slice commit(s) failed; tried again in %.0f ms", failed, self._commit_s * 1000)
            raise StoreUnavailable(f"{failed} slice commit(s) failed")

    def _forget(self, s: Slice) -> None:
        if s in self._ending:
            self._ending.remove(s)
        for account, held in list(self._open.items()):
            if held is s:
                del self._open[account]

    async def close(self) -> None:
        """The worker stops: every admission written, every slice given back."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(StoreUnavailable):
            await self.flush(everything=True)
