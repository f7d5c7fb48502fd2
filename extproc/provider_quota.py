"""A hosted deployment's provider quota (`provider_quota`: requests and tokens per minute, as agreed with
the provider) and each tenant's share of it: token buckets of a minute's size in the store, refilled
continuously the way providers count (scripts.GCRA). A request is charged at its token bound, every
bucket or none, before any byte leaves; settlement gives back what it did not use (its hint's `q`).

**Slices.** The common request does not wait for the store. A worker takes a slice of a quota in one
script (scripts.TAKE_QUOTA): k requests' worth charged at once, each as large as the request that took
it, k at most `store.slice_requests` and at most 1/SHARE of the room any bucket has. So a slice never
lets the provider receive more than the quota (what it admits was charged before), and never takes a
bucket's last room: near the quota requests are charged one by one (scripts.QUOTA), exactly as without
slices, and the one refused learns when the bucket has room. Each request admitted from a slice carries
its own charges in its hint, as one charged alone does, so settlement gives back the same. When the
slice's time is up (`store.slice_ms`) or a request does not fit it, what it holds unused is given back
(scripts.QUOTA_RETURN).

What a crash can strand: a worker that dies holding a slice never gives back its unused part. The
bucket refills it as it refills any charge, within that part's milliseconds: at most 1/SHARE of the
room the bucket had, and at most `slice_requests` requests' worth.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from extproc.config.schema import Deployment
from extproc.single_flight import SingleFlight
from extproc.slices import SHARE
from extproc.store import PERIOD_MS, RateCharge, Store, in_background, quota_key

Account = tuple[tuple[str, float, bool], ...]  # the buckets a slice is of, and how each is charged


def quota_charges(deployment: str, rpm: int | None, tpm: int | None, share: float, tenant: str,
                  tokens: int) -> list[RateCharge]:
    """The buckets a request takes from: the deployment's, and the tenant's share of it (below 1)."""
    out = []
    for kind, limit, cost in (("rpm", rpm, 1), ("tpm", tpm, tokens)):
        if limit is None:
            continue
        out.append(RateCharge(quota_key(deployment, kind), PERIOD_MS / limit, cost, kind == "tpm"))
        if share < 1:
            out.append(RateCharge(quota_key(deployment, kind, tenant), PERIOD_MS / max(1e-9, limit * share), cost,
                                   kind == "tpm"))
    return out


def charges_of(dep: Deployment, tenant: str, tokens: int) -> list[RateCharge]:
    """A request's charges against a hosted deployment's provider quota, at its token bound."""
    q = dep.provider_quota
    assert q is not None
    return quota_charges(dep.deployment, q.requests_per_minute, q.tokens_per_minute,
                         q.tenant_shares.get(tenant, q.default_share), tenant, tokens)


def account_of(charges: list[RateCharge] | tuple[RateCharge, ...]) -> Account:
    return tuple((c.key, c.ms_per_unit, c.per_token) for c in charges)


@dataclass
class QuotaSlice:
    """What this worker holds of one quota's buckets: requests and tokens left to admit."""

    charges: tuple[RateCharge, ...]  # one request's, the request's that took it
    requests: int
    tokens: int  # counted where a bucket counts tokens
    admit_until_ms: int
    ended: bool = False

    def admit(self, tokens: int, now_ms: int) -> bool:
        """A request of `tokens` admitted from what is left (False: it does not fit)."""
        counts_tokens = any(c.per_token for c in self.charges)
        if (self.ended or now_ms >= self.admit_until_ms or self.requests < 1
                or (counts_tokens and tokens > self.tokens)):
            return False
        self.requests -= 1
        if counts_tokens:
            self.tokens -= tokens
        return True

    def unused(self) -> list[tuple[str, float]]:
        """What it holds and did not admit, in each bucket's milliseconds."""
        return [(c.key, c.ms_per_unit * left) for c in self.charges
                if (left := self.tokens if c.per_token else self.requests) > 0]


class ProviderQuotas:
    """This worker's slices of provider quotas, one open per quota (the buckets a request is charged)."""

    def __init__(self, store: Store):
        self.store = store
        self.slicing = (0, 0)  # gateway.yaml store.slice_requests, slice_ms (set by AdmissionControl)
        self._open: dict[Account, QuotaSlice] = {}
        self._taking = SingleFlight()
        self._no_room_until: dict[Account, int] = {}  # no slice asked for until then: too little room

    async def take(self, dep: Deployment, tenant: str, tokens: int) -> tuple[list[RateCharge], int | None]:
        """The request's charges, and None when taken or ms until there is room: from this worker's slice
        of the quota when the request fits one (or one can be taken), without a round trip of its own;
        else charged alone."""
        charges = charges_of(dep, tenant, tokens)
        if not charges:
            return charges, None
        now = int(time.time() * 1000)
        if self.slicing[0] >= 2 and await self._from_slice(charges, tokens, now):
            return charges, None
        ok, wait_ms = await self.store.reserve_quota(now, charges)
        return charges, None if ok else wait_ms

    async def _from_slice(self, charges: list[RateCharge], tokens: int, now: int) -> bool:
        """Admitted from the open slice, or from one taken now (False: too little room for a slice: charge
        the request alone). Every turn admits, or ends a slice and takes the next, so it ends."""
        account = account_of(charges)
        while True:
            held = self._open.get(account)
            if held is not None:
                if held.admit(tokens, now):
                    return True
                self._end(held)
            if self._no_room_until.get(account, 0) > now:
                return False
            self._no_room_until.pop(account, None)
            if await self._taking.joined(account):  # another request of this quota is taking one: share it
                continue
            wanted, slice_ms = self.slicing
            with self._taking.taking(account):
                k = await self.store.take_quota(now, charges, wanted, SHARE)
            if k < 2:
                self._no_room_until[account] = now + slice_ms
                return False
            s = self._open[account] = QuotaSlice(tuple(charges), k, k * tokens, now + slice_ms)
            asyncio.get_running_loop().call_later(slice_ms / 1000, self._end, s)

    def _end(self, s: QuotaSlice) -> None:
        """Its time is up, or a request did not fit: what it holds unused goes back, in the background."""
        if s.ended:
            return
        s.ended = True
        account = account_of(s.charges)
        if self._open.get(account) is s:
            del self._open[account]
        in_background(self.store.return_quota([s.unused()]))

    async def close(self) -> None:
        """The worker stops: what every open slice holds unused goes back now."""
        held = list(self._open.values())
        self._open.clear()
        for s in held:
            s.ended = True
        await self.store.return_quota([s.unused() for s in held])


async def take_provider_quota(store: Store, dep: Deployment, tenant: str,
                              tokens: int) -> tuple[list[RateCharge], int | None]:
    """A request's take of a hosted deployment's provider quota and of the tenant's share of it, at its
    token bound, all or none, in one round trip of its own (no slice): (the charges, None) when taken,
    (the charges, ms until the first bucket that refused has room) when spent. Admission takes the
    first candidate's through its worker's ProviderQuotas (slices); the attempt filter a fallback
    candidate's this way (extproc/service/attempts.py)."""
    return await ProviderQuotas(store).take(dep, tenant, tokens)
