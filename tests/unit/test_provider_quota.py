"""Slices of a provider quota against a real Valkey (extproc/provider_quota.py, scripts TAKE_QUOTA and
QUOTA_RETURN): a worker admits a hosted deployment's requests from its slice without a round trip each,
gives back what the slice held unused, never lets the provider receive more than the quota across
workers, never takes a bucket's last room, and a dead worker's slice strands at most its slice."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from extproc.config import load_snapshot
from extproc.config.schema import Deployment, ProviderQuota
from extproc.provider_quota import SHARE, ProviderQuotas, quota_charges
from extproc.store import PERIOD_MS, RateCharge, Store, quota_key
from tests.conftest import POLICY, valkey_url

TOKENS = 100  # every request's token bound here


def hosted(rpm: int | None, tpm: int | None = None, shares: dict[str, float] | None = None) -> Deployment:
    """The demo's hosted deployment under a fresh name (its own buckets), with this quota."""
    dep = load_snapshot(POLICY).deployments["demo-anthropic"]
    quota = ProviderQuota(requests_per_minute=rpm, tokens_per_minute=tpm, tenant_shares=shares or {})
    return dep.model_copy(update={"deployment": f"d{uuid.uuid4().hex[:8]}", "provider_quota": quota})


def counted(store: Store) -> dict[str, int]:
    """The store's round trips for provider quotas, counted by kind."""
    calls = {"take_quota": 0, "reserve_quota": 0}
    for name in calls:
        real = getattr(store, name)

        def wrapper(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(*args)
        setattr(store, name, wrapper)
    return calls


def quotas(store: Store, slice_requests: int = 16, slice_ms: int = 60_000) -> ProviderQuotas:
    book = ProviderQuotas(store)
    book.slicing = (slice_requests, slice_ms)
    return book


def run(fn: Callable[[Store], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        store = Store(valkey_url(), timeout_ms=5_000)
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(main())


def tat(key: str) -> float:
    return float(redis.Redis.from_url(valkey_url(), decode_responses=True).get(key) or 0)


def test_a_slice_admits_without_a_round_trip_each_and_gives_back_what_it_did_not_use() -> None:
    dep = hosted(rpm=600, tpm=1_000_000)  # 100 ms a request, 0.06 ms a token
    rpm, tpm = quota_key(dep.deployment, "rpm"), quota_key(dep.deployment, "tpm")

    async def go(store: Store) -> tuple[dict[str, int], list[list[RateCharge]], float, float, float]:
        calls = counted(store)
        book = quotas(store)
        before = int(time.time() * 1000)
        taken = []
        for _ in range(5):
            charges, wait_ms = await book.take(dep, "acme", TOKENS)
            assert wait_ms is None
            taken.append(charges)
        held = tat(rpm)
        await book.close()  # the worker stops: 11 of the 16 go back
        return calls, taken, before, held, tat(rpm)

    calls, taken, before, held, after = run(go)
    assert calls == {"take_quota": 1, "reserve_quota": 0}  # one round trip for five requests
    # Each request holds its own charges, as one charged alone does: settlement gives back the same.
    assert all(c == quota_charges(dep.deployment, 600, 1_000_000, 1.0, "acme", TOKENS) for c in taken)
    assert before + 16 * 100 <= held <= before + 16 * 100 + 50  # 16 requests' worth charged at once
    assert held - after == pytest.approx(11 * 100)  # the 11 not admitted given back
    assert tat(tpm) == pytest.approx(held - 16 * 100 + 5 * TOKENS * 0.06, abs=1)  # 5 requests' tokens left


def test_workers_slicing_one_quota_never_pass_it() -> None:
    """Four workers, 200 requests at once against 64 a minute: at most 64 (and what refilled meanwhile)
    reach the provider; near the quota requests are charged one by one, so it is used to the last."""
    dep = hosted(rpm=64)

    async def go(store: Store) -> tuple[int, float, float]:
        books = [quotas(store) for _ in range(4)]
        started = time.monotonic()
        out = await asyncio.gather(*(books[i % 4].take(dep, "acme", TOKENS) for i in range(200)))
        elapsed = time.monotonic() - started
        for b in books:
            await b.close()
        return sum(wait is None for _, wait in out), elapsed, tat(quota_key(dep.deployment, "rpm"))

    admitted, elapsed, held = run(go)
    refilled = elapsed * 64 / 60 + 1
    assert 64 <= admitted <= 64 + refilled
    # What stays charged is what was admitted: every slice's unused part came back.
    assert held - time.time() * 1000 == pytest.approx(admitted * PERIOD_MS / 64, abs=refilled * PERIOD_MS / 64)


def test_no_slice_of_a_quota_s_last_room() -> None:
    """12 a minute: 1/8 of the room is under two requests, so none is sliced; each is charged alone and
    the 13th learns how long until there is room (its Retry-After)."""
    dep = hosted(rpm=12)

    async def go(store: Store) -> tuple[dict[str, int], list[int | None]]:
        calls = counted(store)
        book = quotas(store)
        return calls, [(await book.take(dep, "acme", TOKENS))[1] for _ in range(13)]

    calls, waits = run(go)
    assert waits[:12] == [None] * 12 and waits[12] is not None and waits[12] > 0
    assert calls["take_quota"] == 1 and calls["reserve_quota"] == 13  # no room for a slice: not asked again


def test_a_tenant_s_share_is_sliced_with_the_deployment_s_bucket() -> None:
    dep = hosted(rpm=6_400, shares={"globex": 0.25})  # globex: 1,600 a minute of 6,400

    async def go(store: Store) -> tuple[dict[str, int], float, float]:
        calls = counted(store)
        book = quotas(store)
        for _ in range(3):
            assert (await book.take(dep, "globex", TOKENS))[1] is None
        now = time.time() * 1000
        return calls, tat(quota_key(dep.deployment, "rpm")) - now, tat(quota_key(dep.deployment, "rpm", "globex")) - now

    calls, deployment, share = run(go)
    assert calls == {"take_quota": 1, "reserve_quota": 0}
    assert deployment == pytest.approx(16 * PERIOD_MS / 6_400, abs=20)  # both buckets hold the slice's 16
    assert share == pytest.approx(16 * PERIOD_MS / 1_600, abs=20)


def test_a_request_that_does_not_fit_ends_the_slice_and_takes_the_next() -> None:
    dep = hosted(rpm=None, tpm=1_000_000)

    async def go(store: Store) -> tuple[dict[str, int], float]:
        calls = counted(store)
        book = quotas(store)
        before = int(time.time() * 1000)
        assert (await book.take(dep, "acme", TOKENS))[1] is None  # a slice of 16 x 100 tokens
        assert (await book.take(dep, "acme", 5_000))[1] is None  # larger than the 1,500 left
        await asyncio.sleep(0.05)  # the first slice's unused part returns in the background
        await book.close()
        return calls, tat(quota_key(dep.deployment, "tpm")) - before

    calls, held = run(go)
    assert calls == {"take_quota": 2, "reserve_quota": 0}
    assert held == pytest.approx((TOKENS + 5_000) * PERIOD_MS / 1_000_000, abs=20)  # what was admitted


def test_a_dead_worker_s_slice_strands_at_most_its_share_of_the_room() -> None:
    """A worker that dies holding a slice never gives its unused part back: at most 1/SHARE of the room
    the bucket had, which the bucket refills as it refills any charge; the other workers keep the rest."""
    dep = hosted(rpm=64)

    async def go(store: Store) -> tuple[float, int]:
        dead = quotas(store)
        assert (await dead.take(dep, "acme", TOKENS))[1] is None  # then the worker is gone
        stranded = tat(quota_key(dep.deployment, "rpm")) - time.time() * 1000
        alive = quotas(store)
        out = [await alive.take(dep, "acme", TOKENS) for _ in range(64)]
        return stranded, sum(wait is None for _, wait in out)

    stranded, admitted = run(go)
    assert stranded <= 64 / SHARE * PERIOD_MS / 64 + 5  # 8 requests' worth
    assert 64 - 64 / SHARE <= admitted <= 64 - 64 / SHARE + 1  # everything else (and what refilled)
