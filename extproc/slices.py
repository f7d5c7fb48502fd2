"""Slices: a worker admits requests against a slice of a tenant's budgets, quotas and bulkhead that it
took from the store, so the common request does not wait for the store.

A slice is taken in one script (scripts.TAKE_SLICE) under the same limits a reservation is checked
against: it holds k requests' worth (each as large as the request that took it) of every budget, quota
and permit the tenant's requests of that kind draw on, k at most `slice_requests` and at most 1/SHARE
of what any limit has left - so slices never overshoot a limit (what they hold is counted as reserved)
and never take its last room (near a limit, requests reserve one by one, exactly). The worker then
admits each request that fits what the slice has left, for at most `slice_ms`. Each admission is
written to the store at once (scripts.COMMIT_SLICE), before the decision goes on and without waiting
for the reply: it is in the store before Envoy can dispatch the request, whatever becomes of this
worker, and becomes a reservation of its own there, which settles, expires and is swept like one. An
outcome that reaches the store before its admission waits in the slice (scripts.SETTLE), and the
admission settles it. When the slice's time is up, or a request does not fit it, its last write gives
back what it holds unused.

What a crash can strand: a worker that dies holding a slice leaves what it holds unused until the
slice expires (its admitting time, plus the lease of one of its requests); then the sweeper ends it and
gives that back. Record 0033 has the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from extproc.config.schema import StoreSettings
from extproc.single_flight import SingleFlight
from extproc.store import (
    SLICE_MEMBER,
    Reservation,
    SliceAdmission,
    SliceCommit,
    Store,
    StoreUnavailable,
    packed,
)

SHARE = 8  # a slice takes at most 1/SHARE of what any limit has left (budgets, quotas, slots, provider quotas)

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
    pending: list[SliceAdmission] = field(default_factory=list)  # writes that failed: tried again
    closed: bool = False  # no more admissions: its next commit is its last

    def admit(self, r: Reservation) -> tuple[Reservation, SliceAdmission] | None:
        """`r` admitted from what is left (its hint names the slice) and its admission to write, or None
        when it does not fit."""
        if (self.closed or r.now_ms >= self.admit_until_ms or self.requests < 1 or r.micros > self.micros
                or r.tokens > self.tokens):
            return None
        self.micros -= r.micros
        self.tokens -= r.tokens
        self.requests -= 1
        member = f"{SLICE_MEMBER}{self.id}:{self.size - self.requests}"
        admitted = dataclasses.replace(r, slice_id=self.id)
        return admitted, SliceAdmission(r.rid, member, r.micros, r.tokens, r.lease_until_ms, packed(r.record),
                                        admitted.hint)

    def commit(self, admissions: list[SliceAdmission], final: bool) -> SliceCommit:
        return SliceCommit(self.tenant, self.id, self.budgets, self.rates, admissions, final, NOT_PROCESSED,
                           lost_facts(self.tenant))

    def due(self, now_ms: int) -> SliceCommit | None:
        """What to write now (the failed writes again; the end, once its time is up), or None."""
        if now_ms >= self.admit_until_ms or self.requests < 1:
            self.closed = True
        if not self.pending and not self.closed:
            return None
        batch, self.pending = self.pending, []
        return self.commit(batch, self.closed)


class SliceBook:
    """This worker's slices, one open per account kind, and the task that ends them (and writes again
    what failed)."""

    def __init__(self, store: Store):
        self.store = store
        self._ids = (f"{uuid.uuid4().hex[:12]}.{n}" for n in itertools.count(1))
        self._open: dict[tuple[Any, ...], Slice] = {}
        self._ending: list[Slice] = []  # closed, their last commit not yet written
        self._taking = SingleFlight()
        # Accounts whose limits had too little room for a slice, and until when none is asked for (their
        # requests reserve one by one, exactly, meanwhile).
        self._no_room: dict[tuple[Any, ...], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._commit_s = 0.02

    async def admit(self, r: Reservation, settings: StoreSettings, kind: str = "") -> Reservation | None:
        """`r` admitted from this worker's slice of its account (taking one when none fits), or None:
        reserve it in the store on its own. Requests of one `kind` share slices (streams and JSON answers
        apart: a stream's lease is far longer, and a slice lasts as long as its longest). StoreUnavailable
        when a slice was needed and the store did not answer."""
        account = (kind, *account_of(r))
        for _ in range(2):
            current = self._open.get(account)
            if current is not None and r.lease_until_ms > current.expires_ms:
                return None  # a longer lease than the slice's (another route's): this one reserves alone
            if current is not None:
                if (admitted := current.admit(r)) is not None:
                    await self._write(current, admitted[1])
                    return admitted[0]
                current.closed = True
                self._ending.append(self._open.pop(account))
            if self._no_room.get(account, 0) > r.now_ms:
                return None
            if await self._taking.joined(account):  # another request of the account is taking one: share it
                continue
            with self._taking.taking(account):
                taken = await self._take(r, settings)
            if taken is None:
                self._no_room[account] = r.now_ms + settings.slice_ms
                return None
            self._no_room.pop(account, None)
            self._open[account] = taken
        return None

    def admit_now(self, r: Reservation, kind: str = "") -> Reservation | None:
        """`r` admitted from the open slice of its account without waiting for anything - its admission's
        bytes written now - or None (no open slice fits it, or its write cannot leave at once): admit()."""
        current = self._open.get((kind, *account_of(r)))
        if current is None or r.lease_until_ms > current.expires_ms or not self.store.commits_now():
            return None
        if (admitted := current.admit(r)) is None:
            return None
        sent = self.store.commit_now(current.commit([admitted[1]], False))
        assert sent is not None  # (commits_now said so, and nothing ran in between)
        sent.add_done_callback(functools.partial(self._written, current, admitted[1]))
        return admitted[0]

    async def _take(self, r: Reservation, settings: StoreSettings) -> Slice | None:
        """A slice like `r`: it admits for slice_ms, and expires once the lease of a request like `r`
        admitted last would have."""
        slice_id = next(self._ids)
        admit_until = r.now_ms + settings.slice_ms
        expires = admit_until + (r.lease_until_ms - r.now_ms)
        k = await self.store.take_slice(r, slice_id, expires, settings.slice_requests, SHARE)
        if k < 2:
            return None
        self._commit_s = settings.slice_commit_ms / 1000
        self._start()
        return Slice(slice_id, r.tenant, tuple(b.key for b in r.budgets),
                     tuple((q.key, q.ms_per_unit, q.per_token) for q in r.rates),
                     k * r.micros, k * r.tokens, k, k, admit_until, expires)

    async def _write(self, s: Slice, a: SliceAdmission) -> None:
        """The admission written to the store before the decision goes on: its bytes leave now and the
        decision does not wait for the reply - so it is in the store before Envoy can dispatch the
        request, whatever then becomes of this worker. A reply that says it failed queues it to be
        written again (writing it twice changes nothing). Where it cannot be written at once (a
        cluster, replicas to wait for) the decision waits for it, and fails closed when it fails."""
        commit = s.commit([a], False)
        sent = self.store.commit_now(commit)
        if sent is None:
            (out,) = await self.store.commit_slices([commit])
            if isinstance(out, BaseException):
                raise out
            return
        sent.add_done_callback(functools.partial(self._written, s, a))

    def _written(self, s: Slice, a: SliceAdmission, reply: asyncio.Future[Any]) -> None:
        if reply.exception() is not None:
            s.pending.append(a)
            self._stop_admitting()
            _log.warning("a slice's admission was not written (%s); tried again in %.0f ms", reply.exception(),
                         self._commit_s * 1000)

    def _stop_admitting(self) -> None:
        """The store is not answering: nothing more is admitted from a slice until it does (what was
        admitted is written when it answers again)."""
        for account, s in list(self._open.items()):
            s.closed = True
            self._ending.append(self._open.pop(account))

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._open or self._ending:
            await asyncio.sleep(self._commit_s)
            with contextlib.suppress(StoreUnavailable):
                await self.flush()

    async def flush(self, everything: bool = False) -> None:
        """Write again the admissions whose write failed, and end the slices whose time is up (all of them
        when `everything`: the worker stops). What fails is tried again at the next flush."""
        now_ms = int(time.time() * 1000)
        if everything:
            for s in self._open.values():
                s.closed = True
        slices = [*self._ending, *self._open.values()]
        commits = [(s, c) for s in slices if (c := s.due(now_ms)) is not None]
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
            self._stop_admitting()
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
