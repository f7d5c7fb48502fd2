"""The Redis-protocol store: reservations with leases, budgets, quotas, bulkheads, idempotency and
the ledger. One async client (redis-py) behind this small interface; every change is a Lua script.

Keys carry the tenant as a hash tag (`llmgw:{acme}:...`): everything one request touches lives in
one slot, so the scripts also run on Redis Cluster. A store that cannot answer within
`store.timeout_ms` raises StoreUnavailable, which the stages turn into 503 (fail closed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from extproc.config.schema import StoreSettings
from extproc.metrics import observe_store
from extproc.store.cluster import ClusterPipe
from extproc.store.errors import StoreUnavailable
from extproc.store.pipe import ScriptPipe
from extproc.store.scripts import (
    ADMIT,
    APPEND_ONCE,
    ATTEMPT,
    COMMIT_SLICE,
    DECISIONS,
    LEAVE,
    QUOTA,
    QUOTA_RETURN,
    RELEASE_SLOT,
    RESERVE,
    SETTLE,
    TAKE_QUOTA,
    TAKE_SLICE,
    TAKE_SLOTS,
)

__all__ = ["Store", "StoreUnavailable"]

_log = logging.getLogger("llmgw.store")

PERIOD_MS = 60_000  # quotas are per minute
LEDGERED_TTL_S = 3_600  # how long a refusal's ledger entry is known written: longer than any retry


def packed(doc: Any) -> bytes:
    """Compact JSON for what the scripts store (ledger facts, outcomes, hints): orjson, several times
    faster than the standard library on the per-request path; the ledger reads it back as JSON."""
    return orjson.dumps(doc)


def in_background(call: Coroutine[Any, Any, Any]) -> None:
    """A store call nothing waits for (a slot, a quota's unused part given back): its failure is left to
    what ends the hold by itself (a lease's end, a bucket's refill)."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def tag(tenant: str) -> str:
    return f"llmgw:{{{tenant}}}"


def res_key(tenant: str, rid: str) -> str:
    return f"{tag(tenant)}:res:{rid}"


def leases_key(tenant: str) -> str:
    return f"{tag(tenant)}:leases"


def inflight_key(tenant: str) -> str:
    return f"{tag(tenant)}:inflight"


def ledger_key(tenant: str) -> str:
    return f"{tag(tenant)}:ledger"


def ledgered_key(tenant: str, rid: str) -> str:
    """Set once a request's refusal is in the ledger: a late reserve of it is refused (RESERVE)."""
    return f"{tag(tenant)}:ledgered:{rid}"


def unprocessed_key(tenant: str, rid: str) -> str:
    """Set when Envoy answered the request itself because its decision never came (`not_processed`): a
    reserve of it still on its way is refused (RESERVE), so nothing is held for a request no upstream
    will see - and charged in full when its lease expires."""
    return f"{tag(tenant)}:unprocessed:{rid}"


def slice_key(tenant: str, slice_id: str) -> str:
    """A slice a worker holds of the tenant's budgets, quotas and bulkhead (extproc/slices.py)."""
    return f"{tag(tenant)}:slice:{slice_id}"


SLICE_MEMBER = "~"  # a slice's permits in the tenant's leases set: `~<slice id>:<j>`


def decisions_key(tenant: str) -> str:
    """The decision log (gateway.yaml `decision_log`, and every dry-run difference)."""
    return f"{tag(tenant)}:decisions"


def dry_run_key(candidate_revision: str) -> str:
    """Counts of one dry-run candidate: `evaluated`, `differing`, and one field per kind of difference."""
    return f"llmgw:dryrun:{candidate_revision}"


def budget_key(tenant: str, name: str, window_id: str) -> str:
    return f"{tag(tenant)}:budget:{name}:{window_id}"


def rate_key(tenant: str, name: str, kind: str) -> str:
    return f"{tag(tenant)}:rate:{name}:{kind}"


def idem_key(tenant: str, key_hash: str) -> str:
    return f"{tag(tenant)}:idem:{key_hash}"


def idempotency_key_sha256(key: str) -> str:
    """An Idempotency-Key as the store (idem_key) and the ledger (`idempotency_key_sha256`) name it."""
    return hashlib.sha256(key.encode()).hexdigest()


def slots_key(pool: str) -> str:
    """A pool's admitted requests (extproc/admission.py): its own hash tag, shared by every tenant."""
    return f"llmgw:{{admit:{pool}}}:slots"


def queue_keys(pool: str) -> list[str]:
    """A pool's admission queue: its waiters in order, when each stops waiting, and the fair-queuing tags."""
    return [f"llmgw:{{admit:{pool}}}:{k}" for k in ("waiting", "wait_ends", "tags")]


def quota_key(deployment: str, kind: str, tenant: str = "") -> str:
    """A provider quota's bucket (kind rpm or tpm): the deployment's, or one tenant's share of it."""
    return f"llmgw:{{pq:{deployment}}}:{kind}" + (f":{tenant}" if tenant else "")


def returned_ms(hint: dict[str, Any], charged_tokens: int, released: bool) -> list[tuple[str, float]]:
    """What a settled request gives back of the provider quota it held (the hint's `q`): the tokens it
    did not use of its bound; everything when it was never dispatched (released)."""
    out = []
    for key, ms, cost, per_token in hint.get("q", ()):
        if released:
            out.append((key, ms * cost))
        elif per_token and cost > charged_tokens >= 0:
            out.append((key, ms * (cost - charged_tokens)))
    return out


@dataclass(frozen=True)
class BudgetCharge:
    key: str
    limit_micros: int | None
    limit_tokens: int | None
    expire_at_s: int  # the window's end plus a margin; 0 = never (total budgets)


@dataclass(frozen=True)
class RateCharge:
    """One bucket a request takes from (GCRA, scripts.GCRA): a quota of the gateway's, or a provider's."""

    key: str
    ms_per_unit: float  # PERIOD_MS / limit
    cost: int  # 1 for requests, the token bound for tokens
    per_token: bool  # corrected to actual tokens at settlement

    def encode(self) -> list[Any]:
        """As a provider quota's hold travels in the hint (`q`, read by returned_ms)."""
        return [self.key, self.ms_per_unit, self.cost, int(self.per_token)]


@dataclass(frozen=True)
class Reservation:
    tenant: str
    rid: str
    now_ms: int
    lease_until_ms: int
    micros: int
    tokens: int
    budgets: Sequence[BudgetCharge]
    rates: Sequence[RateCharge]
    max_in_flight: int | None
    max_in_flight_tokens: int | None
    record: dict[str, Any]  # ledger facts known at admission (no content)
    idem_key: str | None = None
    idem_body_hash: str = ""
    idem_ttl_ms: int = 0

    prompt_bound: int = 0  # for a stream whose usage must be estimated
    slice_id: str = ""  # admitted from a worker's slice (extproc/slices.py): its admission is written behind
    # When the reservation holds several attempts (retries after one that may have run:
    # extproc/stages/retry.py ambiguous_retries): one answering attempt's bound (micros, tokens), then
    # one unanswered attempt's (micros, tokens). None: it holds one attempt.
    attempt_bound: tuple[int, int, int, int] | None = None

    @functools.cached_property
    def hint(self) -> str:
        """What settlement needs without reading the reservation back: the keys it touched (and the
        prompt and token bounds of one attempt: a fallback attempt takes the tokens from its candidate's
        quota; and `e`, one attempt's bound when the reservation holds several).
        Travels in Envoy's metadata, and is stored with the reservation for the sweeper."""
        each = self.attempt_bound
        return packed({"b": [b.key for b in self.budgets],
                       "r": [f"{q.key}={q.ms_per_unit!r}" for q in self.rates if q.per_token],
                       "i": self.idem_key or "", "p": self.prompt_bound, "t": each[1] if each else self.tokens,
                       **({"e": list(each)} if each else {}),
                       **({"s": [self.slice_id, self.micros, self.tokens]} if self.slice_id else {})}).decode()


def unanswered_bound(hint: dict[str, Any]) -> tuple[int, int] | None:
    """What an attempt sent and never answered is charged (micros, tokens), from a reservation's hint;
    None when the reservation holds one attempt (no retry may follow such an attempt)."""
    each = hint.get("e")
    return (int(each[2]), int(each[3])) if each else None


@dataclass(frozen=True)
class SliceAdmission:
    """A request admitted from a slice, as its admission is written behind (scripts.COMMIT_SLICE)."""

    rid: str
    member: str  # the slice's permit it took (`~<slice id>:<j>`)
    micros: int
    tokens: int
    lease_until_ms: int
    record: bytes  # the ledger facts, packed
    hint: str


@dataclass(frozen=True)
class SliceCommit:
    """One slice's admissions to write, and whether the slice ends with them (scripts.COMMIT_SLICE)."""

    tenant: str
    slice_id: str
    budgets: Sequence[str]  # the keys the slice holds of
    rates: Sequence[tuple[str, float, bool]]  # key, ms per unit, per token
    admissions: Sequence[SliceAdmission]
    final: bool
    released: dict[str, Any]  # the outcome of a request Envoy answered itself
    lost_facts: dict[str, Any]  # the ledger facts of a request whose admission died with its worker


@dataclass(frozen=True)
class ReserveResult:
    outcome: str  # ok, budget_exhausted, rate_limited, concurrency_limited, idempotency_*, replay
    detail: tuple[str, ...] = ()


# The state an Idempotency-Key is left in when its request may have run and nothing says what it did:
# a retry with the key is refused, naming the request, until an operator resolves it (invariant 21).
IDEM_AMBIGUOUS = "ambiguous"


@dataclass(frozen=True)
class Replayable:
    """A completed idempotent answer as the store keeps it for replay (extproc/replay.py seals it)."""

    status: int
    sealed: str
    ttl_ms: int


@dataclass(frozen=True)
class Settlement:
    """How one reservation ends, as settlement decided it: the SETTLE script's one input."""

    tenant: str
    rid: str
    outcome: dict[str, Any]  # the settlement half of the ledger entry
    micros: int = -1  # the charge; -1: the whole reservation (its outcome is not known)
    tokens: int = -1
    replay: Replayable | None = None  # a completed idempotent answer
    hint: str | None = None  # the keys the reservation touched (Reservation.hint); None: read them first
    # What the attempts before the answering one are charged (micros, tokens): those sent and never
    # answered, at their bound (extproc/settlement/charge.py earlier_charges). None: the attempts are
    # not known (the sweeper's charge in full), and -1 above stays the whole reservation; known, -1
    # is one attempt's bound (the hint's `e`) and the total is theirs added to the answer's.
    earlier: tuple[int, int] | None = None

    def amounts(self) -> tuple[int, int]:
        """(micros, tokens) for SETTLE (-1: the whole reservation; the script cuts any charge to it)."""
        if self.earlier is None:
            return self.micros, self.tokens
        each = (orjson.loads(self.hint).get("e") if self.hint and '"e"' in self.hint else None) or (-1, -1)
        micros, tokens = (each[0] if self.micros < 0 else self.micros), (each[1] if self.tokens < 0 else self.tokens)
        if micros < 0 or tokens < 0:  # the reservation holds one attempt: the whole of it
            return -1, -1
        return micros + self.earlier[0], tokens + self.earlier[1]

    @property
    def idempotency(self) -> tuple[str, str, int]:
        """What becomes of the request's Idempotency-Key (its status, kept answer, TTL for SETTLE): a
        completed answer is kept for replay; a request charged in full because it may have run and
        reported nothing (an ambiguous outcome, a lease that expired) leaves its key `ambiguous` -
        dispatching a retry could do twice what may have been done once; any other outcome is known
        (nothing ran, or it failed and said so), and the key is forgotten: a retry may run."""
        if self.replay is not None:
            return str(self.replay.status), self.replay.sealed, self.replay.ttl_ms
        return (IDEM_AMBIGUOUS if self.micros < 0 else ""), "", 0


@dataclass(frozen=True)
class Settled:
    reserved_micros: int
    reserved_tokens: int
    charged_micros: int
    charged_tokens: int


@dataclass(frozen=True)
class BudgetUse:
    reserved_micros: int
    settled_micros: int
    reserved_tokens: int
    settled_tokens: int


@dataclass(frozen=True)
class Occupancy:
    leases: dict[str, int]  # tenant -> open reservations
    inflight_tokens: dict[str, int]  # tenant -> tokens reserved by them
    budgets: dict[str, BudgetUse]  # budget key (current window) -> its use
    slots: dict[str, int] = field(default_factory=dict)  # pool with admission -> slots held (leases unexpired)
    waiting: dict[str, int] = field(default_factory=dict)  # pool with admission -> requests in its queue


class Store:
    def __init__(self, url: str, timeout_ms: int = 250, cluster: bool = False, replica_acks: int = 0,
                 replica_ack_timeout_ms: int = 0):
        timeout = timeout_ms / 1000
        opts: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                                "decode_responses": True, "health_check_interval": 0}
        # The scripts every request runs go through the pipe; the rest (reads, counts) through redis-py.
        self.pipe: ScriptPipe | ClusterPipe
        self.client: redis.Redis | RedisCluster
        if cluster:
            self.client = RedisCluster.from_url(url, cluster_error_retry_attempts=1, **opts)
            self.pipe = ClusterPipe(url, timeout, replica_acks, replica_ack_timeout_ms)
        else:
            self.client = redis.Redis.from_url(url, retry_on_timeout=False, **opts)
            self.pipe = ScriptPipe(url, timeout, replica_acks, replica_ack_timeout_ms)

    @classmethod
    def from_settings(cls, url: str, s: StoreSettings) -> Store:
        return cls(url, s.timeout_ms, s.cluster, s.replica_acks, s.replica_ack_timeout_ms)

    async def prepare(self) -> None:
        """At start: the hot-path connection open and its scripts loaded (StoreUnavailable if not)."""
        await self.pipe.load(RESERVE, SETTLE, ADMIT, QUOTA, TAKE_QUOTA, TAKE_SLICE, COMMIT_SLICE, TAKE_SLOTS)

    async def close(self) -> None:
        await self.pipe.close()
        await self.client.aclose()

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (RedisError, OSError) as e:
            raise StoreUnavailable(f"store unavailable: {type(e).__name__}") from None

    async def reserve(self, r: Reservation) -> ReserveResult:
        t = r.tenant
        idem = r.idem_key or f"{tag(t)}:idem:-"
        keys = [res_key(t, r.rid), leases_key(t), inflight_key(t), idem, ledgered_key(t, r.rid),
                *(b.key for b in r.budgets), *(q.key for q in r.rates), unprocessed_key(t, r.rid)]
        args: list[Any] = [
            r.rid, r.now_ms, r.lease_until_ms, r.micros, r.tokens,
            -1 if r.max_in_flight is None else r.max_in_flight,
            -1 if r.max_in_flight_tokens is None else r.max_in_flight_tokens,
            len(r.budgets), len(r.rates), r.idem_body_hash, r.idem_ttl_ms,
            packed(r.record), r.hint,
        ]
        for b in r.budgets:
            args += [-1 if b.limit_micros is None else b.limit_micros,
                     -1 if b.limit_tokens is None else b.limit_tokens, b.expire_at_s]
        for q in r.rates:
            args += [repr(q.ms_per_unit), q.cost]
        started = time.perf_counter()
        out = await self.pipe.evalsha(RESERVE, keys, args)
        observe_store("reserve", time.perf_counter() - started)
        return ReserveResult(out[0], tuple(str(x) for x in out[1:]))

    async def take_slice(self, r: Reservation, slice_id: str, expires_ms: int, wanted: int, share: int) -> int:
        """A slice of `wanted` requests like `r` (scripts.TAKE_SLICE) for a worker to admit from: how many
        it holds (0: too little room left; `r` reserves on its own)."""
        t = r.tenant
        keys = [slice_key(t, slice_id), leases_key(t), inflight_key(t), *(b.key for b in r.budgets),
                *(q.key for q in r.rates)]
        args: list[Any] = [slice_id, r.now_ms, expires_ms, wanted, r.micros, r.tokens,
                           -1 if r.max_in_flight is None else r.max_in_flight,
                           -1 if r.max_in_flight_tokens is None else r.max_in_flight_tokens,
                           len(r.budgets), len(r.rates), share]
        for b in r.budgets:
            args += [-1 if b.limit_micros is None else b.limit_micros,
                     -1 if b.limit_tokens is None else b.limit_tokens, b.expire_at_s]
        for q in r.rates:
            args += [repr(q.ms_per_unit), q.cost]
        args.append(packed({"b": [b.key for b in r.budgets],
                            "r": [[q.key, q.ms_per_unit, q.per_token] for q in r.rates]}))
        started = time.perf_counter()
        out = await self.pipe.evalsha(TAKE_SLICE, keys, args)
        observe_store("take_slice", time.perf_counter() - started)
        return int(out[0])

    @staticmethod
    def _commit_call(c: SliceCommit) -> tuple[list[str], list[Any]]:
        t = c.tenant
        keys = [slice_key(t, c.slice_id), leases_key(t), inflight_key(t), ledger_key(t), *c.budgets,
                *(k for k, _, _ in c.rates)]
        args: list[Any] = [c.slice_id, int(c.final), len(c.budgets), len(c.rates), packed(c.released),
                           packed(c.lost_facts)]
        for _, ms, per_token in c.rates:
            args += [repr(ms), int(per_token)]
        for a in c.admissions:
            keys += [res_key(t, a.rid), unprocessed_key(t, a.rid), ledgered_key(t, a.rid)]
            args += [a.rid, a.member, a.micros, a.tokens, a.lease_until_ms, a.record, a.hint]
        return keys, args

    async def commit_slices(self, commits: Sequence[SliceCommit]) -> list[Any]:
        """Slices' admissions written (and final ones ended), one script each, pipelined: per commit,
        {admissions written, settled} or its exception."""
        started = time.perf_counter()
        out = await self.pipe.evalsha_many(COMMIT_SLICE, [self._commit_call(c) for c in commits])
        observe_store("commit_slices", time.perf_counter() - started)
        return out

    def commits_now(self) -> bool:
        """Whether commit_now can write at once (the pipe connected, the script loaded, no WAIT)."""
        ready = getattr(self.pipe, "ready_now", None)
        return ready is not None and ready(COMMIT_SLICE)

    def commit_now(self, c: SliceCommit) -> asyncio.Future[Any] | None:
        """A slice's admissions written to the store before the caller goes on (ScriptPipe.send_now), the
        reply left to come; None when they cannot be written at once (then: commit_slices)."""
        send = getattr(self.pipe, "send_now", None)  # a cluster's pipe routes by slot first: it awaits
        return send(COMMIT_SLICE, *self._commit_call(c)) if send is not None else None

    async def slice_held(self, tenant: str, slice_id: str) -> dict[str, str]:
        """What a slice holds (the sweeper ends a dead worker's; empty when it has ended)."""
        held: dict[str, str] = await self._call(self.client.hgetall(slice_key(tenant, slice_id)))
        return held

    async def admit(self, pool: str, rid: str, now_ms: int, lease_until_ms: int, limit: int, priority: int,
                    tenant: str, weight: float, wait_until_ms: int = 0) -> tuple[bool, float | None]:
        """A slot of the pool for this request (scripts.ADMIT): (True, None) admitted; (False, None)
        refused without waiting; (False, start tag) waiting in the pool's queue - ask again to learn
        whether it is admitted (the same call)."""
        started = time.perf_counter()
        out = await self.pipe.evalsha(ADMIT, [slots_key(pool), *queue_keys(pool)],
                                      [rid, now_ms, lease_until_ms, limit, priority, tenant, repr(weight),
                                       wait_until_ms])
        observe_store("admit", time.perf_counter() - started)
        if int(out[0]) == 1:
            return True, None
        return False, (float(out[2]) if int(out[1]) == 1 else None)

    async def leave(self, pool: str, rid: str) -> None:
        """A waiter leaves the pool's queue (its wait ended, its client went away)."""
        await self.pipe.evalsha(LEAVE, queue_keys(pool), [rid])

    async def release_slot(self, pool: str, *slots: str) -> None:
        """Slots given back: request ids, or a slice's members."""
        if slots:
            await self.pipe.evalsha(RELEASE_SLOT, [slots_key(pool)], list(slots))

    async def take_slots(self, pool: str, slice_id: str, now_ms: int, expires_ms: int, wanted: int, limit: int,
                         share: int) -> int:
        """A worker's slice of a pool's slots (scripts.TAKE_SLOTS): how many it holds (0: none)."""
        started = time.perf_counter()
        out = await self.pipe.evalsha(TAKE_SLOTS, [slots_key(pool), queue_keys(pool)[0]],
                                      [slice_id, now_ms, expires_ms, wanted, limit, share])
        observe_store("take_slots", time.perf_counter() - started)
        return int(out)

    async def reserve_quota(self, now_ms: int, charges: Sequence[RateCharge]) -> tuple[bool, int]:
        """Every bucket charged, or none: (True, 0), or (False, ms until the first refusing one has room)."""
        started = time.perf_counter()
        out = await self.pipe.evalsha(QUOTA, [c.key for c in charges],
                                      [now_ms, *(x for c in charges for x in (repr(c.ms_per_unit), c.cost))])
        observe_store("quota", time.perf_counter() - started)
        return (True, 0) if out[0] == "ok" else (False, int(out[1]))

    async def take_quota(self, now_ms: int, charges: Sequence[RateCharge], wanted: int, share: int) -> int:
        """A worker's slice of a provider quota (scripts.TAKE_QUOTA): `wanted` requests like the one
        `charges` are for, charged at once; how many it holds (0: too little room, nothing charged)."""
        started = time.perf_counter()
        args = [now_ms, wanted, share, *(x for c in charges for x in (repr(c.ms_per_unit), c.cost))]
        out = await self.pipe.evalsha(TAKE_QUOTA, [c.key for c in charges], args)
        observe_store("take_quota", time.perf_counter() - started)
        return int(out)

    async def return_quota(self, backs: Sequence[Sequence[tuple[str, float]]]) -> None:
        """Milliseconds given back to provider quotas' buckets, one script per list (each list's buckets
        are one deployment's, in its slot). A return that fails only under-uses the provider: logged."""
        calls = [([k for k, _ in back], [repr(ms) for _, ms in back]) for back in backs if back]
        failed = [r for r in (await self.pipe.evalsha_many(QUOTA_RETURN, calls) if calls else [])
                  if isinstance(r, BaseException)]
        if failed:
            _log.warning("%d quota return(s) failed: %s", len(failed), failed[0])

    async def _return_quotas(self, items: Sequence[tuple[str, int, bool]]) -> None:
        """What settled requests held of a provider quota and did not use, given back. Items: (hint,
        charged tokens, released before dispatch)."""
        await self.return_quota([returned_ms(orjson.loads(hint), charged, released)
                                 for hint, charged, released in items])

    async def mark_unprocessed(self, rid: str, tenants: Sequence[str]) -> tuple[str, str] | None:
        """Envoy answered request `rid` itself (its decision never came): no tenant's reserve of it may
        hold anything from now on, and the tenant already holding one (and its hint), if any, is
        returned to be released. The marks come first: a reserve either ran before them (found here)
        or is refused by them - none slips between."""
        pipe = self.client.pipeline(transaction=False)
        for t in tenants:
            pipe.set(unprocessed_key(t, rid), "1", ex=LEDGERED_TTL_S)
        await self._call(pipe.execute())
        return await self.holder_of(rid, tenants)

    async def holder_of(self, rid: str, tenants: Sequence[str]) -> tuple[str, str] | None:
        """The tenant holding an open reservation for request `rid`, and its hint, looked for among
        `tenants` in one pipelined round trip: for a request whose decision never reached Envoy, the
        access log knows the request's id and nothing else."""
        pipe = self.client.pipeline(transaction=False)
        for t in tenants:
            pipe.hget(res_key(t, rid), "hint")
        hints = await self._call(pipe.execute())
        return next(((t, h) for t, h in zip(tenants, hints, strict=True) if h is not None), None)

    async def reservation(self, tenant: str, rid: str) -> dict[str, str]:
        held: dict[str, str] = await self._call(self.client.hgetall(res_key(tenant, rid)))
        return held

    @staticmethod
    def _settle_call(s: Settlement) -> tuple[list[str], list[Any]]:
        assert s.hint is not None  # (settle reads it first when it was not known)
        h = orjson.loads(s.hint) if s.hint else {}
        budgets: list[str] = h.get("b", [])
        tpm = [item.rsplit("=", 1) for item in h.get("r", [])]
        keys = [res_key(s.tenant, s.rid), leases_key(s.tenant), inflight_key(s.tenant), ledger_key(s.tenant),
                h.get("i") or f"{tag(s.tenant)}:idem:-", *budgets, *(k for k, _ in tpm)]
        idem_status, idem_response, idem_ttl_ms = s.idempotency
        args: list[Any] = [s.rid, *s.amounts(), packed(s.outcome), len(budgets), len(tpm),
                           idem_status, idem_response, idem_ttl_ms, *(ms for _, ms in tpm)]
        if sliced := h.get("s"):  # its admission may not be written yet: the outcome can wait in the slice
            keys.append(slice_key(s.tenant, sliced[0]))
            args += sliced
        return keys, args

    async def settle(self, s: Settlement) -> Settled | None:
        """Settle once: budgets move from reserved to settled, the lease and permit are released and the
        ledger entry is appended, in one script. None when it was already settled (by anyone). A
        settlement without its hint (the keys the reservation touched, which the filters have from
        Envoy's metadata) costs one more round trip to read them."""
        if s.hint is None:
            held = await self.reservation(s.tenant, s.rid)
            if not held:
                return None
            s = dataclasses.replace(s, hint=held.get("hint", ""))
        (out,) = await self._settle_batch([s])
        if isinstance(out, BaseException):
            raise out
        if not out or int(out[0]) != 1:
            return None
        return Settled(*(int(x) for x in out[1:5]))

    async def settle_many(self, items: list[Settlement]) -> list[bool]:
        """Many settlements, pipelined on the one connection; each is still its own script. Returns,
        per item, whether this was its settlement (False: an earlier one had won)."""
        started = time.perf_counter()
        results = await self._settle_batch(items)
        observe_store("settle_batch", time.perf_counter() - started)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise StoreUnavailable(f"{len(failed)} settlement(s) failed: {failed[0]}")
        return [bool(r) and int(r[0]) == 1 for r in results]

    async def _settle_batch(self, items: Sequence[Settlement]) -> list[Any]:
        """The settlements' scripts, with the pool slots they held given back in the same write (nothing
        waits on those), then what the ones that won held of a provider quota and did not use (known
        once their charges are). Each item's result, or its exception."""
        calls = [self._settle_call(item) for item in items]
        slots = [([slot], [member or item.rid]) for item in items if (slot := _slot_of(item.hint or ""))
                 for member in [_slot_member(item.hint or "")]]
        results, freed = await asyncio.gather(self.pipe.evalsha_many(SETTLE, calls),
                                              self.pipe.evalsha_many(RELEASE_SLOT, slots) if slots else _none())
        if any(isinstance(r, BaseException) for r in freed):  # a slot's lease ends by itself
            _log.warning("%d slot return(s) failed", sum(isinstance(r, BaseException) for r in freed))
        quotas = [(item.hint or "", int(r[4]), _released(item.outcome)) for item, r in zip(items, results, strict=True)
                  if '"q"' in (item.hint or "") and not isinstance(r, BaseException) and r and int(r[0]) == 1]
        if quotas:
            await self._return_quotas(quotas)
        return results

    async def record_attempt(self, tenant: str, rid: str, n: int, record: dict[str, Any], hint: str = "") -> None:
        """One attempt of a fallback route (extproc/service/attempts.py); settlement puts them in the ledger.
        `hint`: the reservation's, which names its slice when it was admitted from one."""
        sliced = orjson.loads(hint).get("s") if '"s"' in hint else None
        await self.pipe.evalsha(ATTEMPT, [res_key(tenant, rid), *([slice_key(tenant, sliced[0])] if sliced else [])],
                                [n, packed(record), rid])

    async def append_ledger(self, tenant: str, rid: str, facts: dict[str, Any], outcome: dict[str, Any]) -> bool:
        """The entry of a request that reserved nothing (denied, refused before dispatch), once:
        False when it was already appended (a retry whose first try's reply was lost)."""
        out = await self.pipe.evalsha(APPEND_ONCE, [ledger_key(tenant), ledgered_key(tenant, rid)],
                                      [packed(facts), packed(outcome), LEDGERED_TTL_S])
        return bool(out)

    async def append_decisions(self, entries: Sequence[tuple[str, bytes]],
                               counts: dict[str, dict[str, int]]) -> None:
        """Decision log entries (tenant, the entry as JSON) and dry-run counts (candidate revision -> field ->
        increment): one script call per tenant and one HINCRBY per count, a batch, never one per
        request."""
        by_tenant: dict[str, list[bytes]] = {}
        for tenant, entry in entries:
            by_tenant.setdefault(tenant, []).append(entry)
        calls = [([decisions_key(t)], list(packs)) for t, packs in by_tenant.items()]
        results = await self.pipe.evalsha_many(DECISIONS, calls) if calls else []
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise StoreUnavailable(f"{len(failed)} decision log write(s) failed: {failed[0]}")
        if counts:
            pipe = self.client.pipeline(transaction=False)
            for revision, fields in counts.items():
                for name, n in fields.items():
                    pipe.hincrby(dry_run_key(revision), name, n)
            await self._call(pipe.execute())

    async def occupancy(self, tenants: Sequence[str], budget_keys: Sequence[str],
                        pools: Sequence[str] = ()) -> Occupancy:
        """What is held right now (for the metrics, at scrape time): per tenant, open leases and
        in-flight tokens; per budget key, reserved and settled micros and tokens; per pool with
        admission, its slots and waiters. One pipeline."""
        now_ms = int(time.time() * 1000)
        pipe = self.client.pipeline(transaction=False)
        for t in tenants:
            pipe.zcard(leases_key(t))
            pipe.hget(inflight_key(t), "tokens")
        for k in budget_keys:
            pipe.hmget(k, "reserved_micros", "settled_micros", "reserved_tokens", "settled_tokens")
        for p in pools:
            pipe.zcount(slots_key(p), now_ms, "+inf")
            pipe.zcount(queue_keys(p)[1], now_ms, "+inf")
        out = await self._call(pipe.execute())
        n, b = len(tenants), len(budget_keys)
        return Occupancy(
            leases={t: int(out[2 * i]) for i, t in enumerate(tenants)},
            inflight_tokens={t: int(out[2 * i + 1] or 0) for i, t in enumerate(tenants)},
            budgets={k: BudgetUse(*(int(v or 0) for v in out[2 * n + i])) for i, k in enumerate(budget_keys)},
            slots={p: int(out[2 * n + b + 2 * i]) for i, p in enumerate(pools)},
            waiting={p: int(out[2 * n + b + 2 * i + 1]) for i, p in enumerate(pools)})

    async def expired_leases(self, tenant: str, now_ms: int, limit: int = 100) -> list[str]:
        rids: list[str] = await self._call(
            self.client.zrangebyscore(leases_key(tenant), "-inf", now_ms, start=0, num=limit))
        return rids


def _slot_of(hint: str) -> str:
    """The pool slot a reservation's hint names ("" when none: no admission-controlled pool)."""
    return str(orjson.loads(hint).get("a") or "") if '"a"' in hint else ""


def _slot_member(hint: str) -> str:
    """The slice member a request's pool slot is (`m` in its hint), or "" when the slot is its own."""
    return str(orjson.loads(hint).get("m") or "") if '"m"' in hint else ""


async def _none() -> list[Any]:
    return []


def _released(outcome: dict[str, Any]) -> bool:
    """A request released before dispatch: it used nothing of a provider quota."""
    return outcome.get("settlement") == "released"


def ledger_entry(fields: dict[str, str]) -> dict[str, Any]:
    """One ledger entry as one record: admission facts, outcome, and the amounts."""
    rec: dict[str, Any] = {**json.loads(fields.get("record") or "{}"), **json.loads(fields.get("outcome") or "{}")}
    if fields.get("attempts"):
        # Each attempt as its filter saw it; what settlement knew of each (the last one's address and
        # first byte, an earlier one's charge) joins it, by its number.
        attempts = json.loads(fields["attempts"])
        settled = rec.get("attempts") or [{}]
        by_n = {a["n"]: a for a in settled if "n" in a}
        for i, att in enumerate(attempts):
            known = by_n.get(att.get("n"), settled[-1] if i == len(attempts) - 1 else {})
            attempts[i] = {**{k: v for k, v in known.items() if k not in ("deployment", "adapter", "status")}, **att}
        rec["attempts"] = attempts
    for k in ("reserved_micros", "reserved_tokens", "charged_micros", "charged_tokens"):
        rec[k] = int(fields.get(k, 0))
    return rec
