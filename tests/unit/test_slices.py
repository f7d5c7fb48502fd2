"""Slices against a real Valkey (extproc/slices.py, scripts TAKE_SLICE and COMMIT_SLICE): a worker admits
from its slice without the store, writes the admissions behind, and every request still settles once
into one ledger entry; slices never overshoot a limit nor take its last room; a slice whose worker died
is ended by the sweeper at its expiry, giving back what it held unused."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import redis

from extproc.config.schema import StoreSettings
from extproc.settlement.sweeper import Sweeper
from extproc.slices import SliceBook
from extproc.store import (
    PERIOD_MS,
    BudgetCharge,
    RateCharge,
    Reservation,
    Settlement,
    SliceCommit,
    Store,
    budget_key,
    inflight_key,
    leases_key,
    ledger_entry,
    ledger_key,
    rate_key,
    res_key,
    unprocessed_key,
)
from tests.conftest import valkey_url

SETTINGS = StoreSettings(slice_requests=8, slice_ms=60_000, slice_commit_ms=10_000)  # commits by hand here
SPAN_MS = 3_000  # a request's lease, from now
DONE = {"termination": "complete", "settlement": "actual", "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


def tenant() -> str:
    return f"s{uuid.uuid4().hex[:8]}"


def request(t: str, rid: str, micros: int = 10, tokens: int = 100, limit_tokens: int | None = 10_000,
            rpm: int | None = None, max_in_flight: int | None = None) -> Reservation:
    now = int(time.time() * 1000)
    rates = [RateCharge(rate_key(t, "q", "rpm"), PERIOD_MS / rpm, 1, False),
             RateCharge(rate_key(t, "q", "tpm"), PERIOD_MS / 1_000_000, tokens, True)] if rpm else []
    return Reservation(tenant=t, rid=rid, now_ms=now, lease_until_ms=now + SPAN_MS, micros=micros, tokens=tokens,
                       budgets=[BudgetCharge(budget_key(t, "b", "total"), None, limit_tokens, 0)], rates=rates,
                       max_in_flight=max_in_flight, max_in_flight_tokens=None,
                       record={"request_id": rid, "tenant": t, "route": "chat"})


def run(fn: Any) -> Any:
    async def main() -> Any:
        store = Store(valkey_url(), timeout_ms=5_000)  # a loaded test machine is not a dead store
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(main())


def sync() -> redis.Redis:
    return redis.Redis.from_url(valkey_url(), decode_responses=True)


def budget(t: str) -> dict[str, int]:
    return {k: int(v) for k, v in sync().hgetall(budget_key(t, "b", "total")).items()}


def ledger(t: str) -> list[dict[str, Any]]:
    return [ledger_entry(f) for _, f in sync().xrange(ledger_key(t))]


def settle(store: Store, r: Reservation, micros: int = 4, tokens: int = 15) -> Any:
    return store.settle(Settlement(r.tenant, r.rid, DONE, micros, tokens, hint=r.hint))


def deferring(store: Store) -> list[SliceCommit]:
    """The store's admission writes held back (returned to the test, to write when it chooses): as if
    their bytes reached the store after the requests' outcomes - or never, their worker dead."""
    held: list[SliceCommit] = []

    def commit_now(c: SliceCommit) -> asyncio.Future[Any]:
        held.append(c)
        sent: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        sent.set_result([0, 0])
        return sent
    store.commit_now = commit_now  # type: ignore[method-assign]
    return held


async def written(store: Store, t: str, rid: str) -> dict[str, str]:
    """The reservation a slice's admission became, once its write (not awaited by the decision) lands."""
    for _ in range(100):
        if held := await store.reservation(t, rid):
            return held
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid}'s admission was never written")


def test_admitted_from_a_slice_written_at_once_settled_once_and_the_rest_given_back() -> None:
    t = tenant()

    async def go(store: Store) -> None:
        book = SliceBook(store)
        held = [await book.admit(request(t, f"r{i}"), SETTINGS) for i in range(3)]
        assert all(h is not None and h.slice_id for h in held)
        assert len({h.slice_id for h in held if h}) == 1  # one slice, one store round trip
        assert budget(t)["reserved_tokens"] == 800  # the slice holds 8 requests' worth
        assert sync().zcard(leases_key(t)) == 8  # its permits count as in flight
        assert (await written(store, t, "r0"))["tokens"] == "100"  # a reservation of its own
        for h in held:
            assert h is not None
            await written(store, t, h.rid)
            assert await settle(store, h) is not None
            assert await settle(store, h) is None  # once
        await book.flush(everything=True)  # the slice ends: what it held unused goes back
    run(go)
    assert budget(t) == {"reserved_micros": 0, "reserved_tokens": 0, "settled_micros": 12, "settled_tokens": 45}
    entries = ledger(t)
    assert sorted(e["request_id"] for e in entries) == ["r0", "r1", "r2"]
    assert all(e["route"] == "chat" and e["charged_tokens"] == 15 and e["reserved_tokens"] == 100 for e in entries)
    assert sync().zcard(leases_key(t)) == 0 and int(sync().hget(inflight_key(t), "tokens")) == 0


def test_an_outcome_before_its_admission_is_written_waits_and_is_settled_by_it() -> None:
    t = tenant()

    async def go(store: Store) -> None:
        book = SliceBook(store)
        late = deferring(store)
        first = await book.admit(request(t, "early"), SETTINGS)
        assert first is not None
        assert await settle(store, first, 3, 30) is not None  # the access log came first
        assert await settle(store, first) is None  # a second settlement of it is refused
        assert not ledger(t)  # the entry waits for the admission's facts
        await store.commit_slices(late)
        await store.commit_slices(late)  # written twice: nothing more
        assert await settle(store, first) is None  # still once, after the admission is written
        await book.flush(everything=True)
    run(go)
    (entry,) = ledger(t)
    assert entry["request_id"] == "early" and entry["route"] == "chat"
    assert (entry["charged_micros"], entry["charged_tokens"], entry["reserved_tokens"]) == (3, 30, 100)
    assert budget(t) == {"reserved_micros": 0, "reserved_tokens": 0, "settled_micros": 3, "settled_tokens": 30}
    assert not sync().exists(res_key(t, "early"))


def test_a_request_envoy_answered_itself_before_its_admission_was_written_is_released() -> None:
    t = tenant()

    async def go(store: Store) -> None:
        book = SliceBook(store)
        late = deferring(store)
        assert await book.admit(request(t, "late"), SETTINGS) is not None
        sync().set(unprocessed_key(t, "late"), "1")  # the access log's mark (Store.mark_unprocessed)
        await store.commit_slices(late)
        await book.flush(everything=True)
    run(go)
    (entry,) = ledger(t)
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released"
    assert entry["charged_tokens"] == 0 and budget(t)["reserved_tokens"] == 0


def test_slices_never_overshoot_nor_take_a_limits_last_room_across_workers() -> None:
    """Four workers admit 40 requests each against a budget of 60: exactly 60 admitted - the first by
    slices, the last one by one in the store - and the budget's reserved plus settled never passes it."""
    t = tenant()
    limit = 60 * 100

    async def go(store: Store) -> list[bool]:
        books = [SliceBook(store) for _ in range(4)]

        async def worker(b: int) -> list[bool]:
            out = []
            for i in range(40):
                r = request(t, f"w{b}r{i}", limit_tokens=limit)
                admitted = await books[b].admit(r, SETTINGS)
                if admitted is None:
                    admitted = r if (await store.reserve(r)).outcome == "ok" else None
                used = await store.client.hgetall(budget_key(t, "b", "total"))  # (not blocking the loop)
                assert int(used.get("reserved_tokens", 0)) + int(used.get("settled_tokens", 0)) <= limit
                out.append(admitted is not None)
            return out
        results = await asyncio.gather(*(worker(b) for b in range(4)))
        for b in books:
            await b.flush(everything=True)
        return [x for r in results for x in r]
    admitted = run(go)
    assert sum(admitted) == 60  # all of the room, no more: slices stop short of the last of it
    assert budget(t)["reserved_tokens"] == 60 * 100


def test_a_slice_takes_no_part_of_a_small_limit() -> None:
    """Room for 10 requests: 1/8 of it is one request, so no slice; the request reserves alone."""
    t = tenant()

    async def go(store: Store) -> Any:
        return await SliceBook(store).admit(request(t, "x", limit_tokens=1_000), SETTINGS)
    assert run(go) is None
    assert budget(t) == {}


def test_a_slice_takes_quota_units_and_gives_back_the_unused() -> None:
    t = tenant()
    tat = rate_key(t, "q", "rpm")

    async def go(store: Store) -> tuple[float, float]:
        book = SliceBook(store)
        assert await book.admit(request(t, "a", rpm=600), SETTINGS) is not None
        taken = float(sync().get(tat)) - time.time() * 1000  # 8 requests at 100 ms each, ahead of now
        await book.flush(everything=True)
        return taken, float(sync().get(tat)) - time.time() * 1000
    taken, left = run(go)
    assert 700 < taken <= 800 and 0 < left <= 100, (taken, left)  # 7 of the 8 units given back


def test_a_slice_whose_worker_died_is_ended_at_its_expiry() -> None:
    """A worker admits four requests and dies; two admissions were written (reservations like any: their
    lease, their sweep), two never reached the store. An outcome that came for one of those is settled
    when the sweeper ends the slice, its facts lost with the worker; the rest goes back."""
    t = tenant()

    async def go(store: Store) -> None:
        book = SliceBook(store)
        held = [await book.admit(request(t, f"d{i}"), SETTINGS) for i in range(2)]
        await written(store, t, "d1")
        deferring(store)  # from here on, nothing this worker writes arrives
        held += [await book.admit(request(t, f"d{i}"), SETTINGS) for i in range(2, 4)]
        assert all(held)
        assert await settle(store, held[0]) is not None  # settled as usual
        assert await settle(store, held[2], 5, 20) is not None  # waits in the slice
        # ...the worker dies: d3's admission and outcome are both lost; d1 is in flight.
        sweeper = Sweeper(store, lambda: [t])
        assert await sweeper.sweep_once(int(time.time() * 1000)) == 0  # nothing has expired yet
        assert budget(t)["reserved_tokens"] == 800 - 100
        swept = await sweeper.sweep_once(int(time.time() * 1000) + 60_000 + SPAN_MS + 1)
        assert swept == 2  # the slice's waiting outcome, and d1's lease
    run(go)
    by_rid = {e["request_id"]: e for e in ledger(t)}
    assert set(by_rid) == {"d0", "d1", "d2"}
    assert by_rid["d2"]["admission"] == "lost with its worker" and by_rid["d2"]["charged_tokens"] == 20
    assert by_rid["d1"]["settlement"] == "ambiguous" and by_rid["d1"]["charged_tokens"] == 100
    assert budget(t) == {"reserved_micros": 0, "reserved_tokens": 0, "settled_micros": 4 + 10 + 5,
                         "settled_tokens": 15 + 100 + 20}
    assert sync().zcard(leases_key(t)) == 0 and int(sync().hget(inflight_key(t), "tokens")) == 0


def test_the_bulkhead_counts_a_slices_permits() -> None:
    t = tenant()

    async def go(store: Store) -> str:
        book = SliceBook(store)
        assert await book.admit(request(t, "a", max_in_flight=32), SETTINGS) is not None
        # 32 permits: a slice of at most 32/8 = 4 holds them; 28 are left for requests reserving alone.
        outcomes = [(await store.reserve(request(t, f"b{i}", max_in_flight=32))).outcome for i in range(29)]
        await book.flush(everything=True)
        return outcomes[-1] + str(outcomes.count("ok"))
    assert run(go) == "concurrency_limited28"


def test_a_request_of_a_longer_lease_reserves_alone() -> None:
    t = tenant()

    async def go(store: Store) -> Any:
        book = SliceBook(store)
        assert await book.admit(request(t, "a"), SETTINGS) is not None
        long = request(t, "b")
        long = dataclasses.replace(long, lease_until_ms=long.now_ms + SETTINGS.slice_ms + SPAN_MS + 1)
        out = await book.admit(long, SETTINGS)
        await book.flush(everything=True)
        return out
    assert run(go) is None


def test_attempts_recorded_before_the_admission_is_written_reach_the_ledger() -> None:
    """A fallback route's attempt filter records each attempt as it happens, which may be before the
    worker writes the admission: the attempts wait in the slice and reach the reservation (written
    first) or the ledger entry (settled first)."""
    t = tenant()

    async def go(store: Store) -> dict[str, str]:
        book = SliceBook(store)
        late = deferring(store)
        first, second = [await book.admit(request(t, rid), SETTINGS) for rid in ("w", "s")]
        assert first is not None and second is not None
        for r in (first, second):
            await store.record_attempt(t, r.rid, 1, {"n": 1, "deployment": "first", "status": 503}, r.hint)
        assert await settle(store, second) is not None
        await store.commit_slices(late)
        held = await store.reservation(t, "w")
        await store.record_attempt(t, "w", 2, {"n": 2, "deployment": "second", "status": 200}, first.hint)
        assert await settle(store, first) is not None
        await book.flush(everything=True)
        return held
    held = run(go)
    assert '"first"' in held["att:1"]
    by_rid = {e["request_id"]: e for e in ledger(t)}
    assert [a["deployment"] for a in by_rid["s"]["attempts"]] == ["first"]
    assert [a["deployment"] for a in by_rid["w"]["attempts"]] == ["first", "second"]


def test_a_request_cancelled_while_another_takes_the_slice_leaves_the_book_admitting() -> None:
    t = tenant()

    async def go(store: Store) -> list[bool]:
        book = SliceBook(store)
        real, release = store.take_slice, asyncio.Event()

        async def slow_take(*args: Any) -> int:
            await release.wait()
            return await real(*args)
        store.take_slice = slow_take  # type: ignore[method-assign]
        taker = asyncio.ensure_future(book.admit(request(t, "taker"), SETTINGS))
        await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(book.admit(request(t, "gone"), SETTINGS))
        await asyncio.sleep(0.01)
        gone.cancel()  # Envoy stopped waiting for its decision
        await asyncio.sleep(0.01)
        release.set()
        first = await asyncio.wait_for(taker, 5)
        store.take_slice = real  # type: ignore[method-assign]
        later = [await asyncio.wait_for(book.admit(request(t, f"later{i}"), SETTINGS), 5) for i in range(3)]
        await book.flush(everything=True)
        return [h is not None for h in (first, *later)]

    assert run(go) == [True] * 4
