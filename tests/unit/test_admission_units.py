"""Admission's pure parts and its store scripts against a real Valkey (extproc/admission.py): the bound
derived from the engines' signals, the pool's one queue (priority, then start-time fair queuing by
tenant weight), leases and waits that end by themselves, and provider quotas with what settlement
gives back. Through Envoy: tests/e2e/budgets/test_admission_e2e.py and test_provider_quota_e2e.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
import redis

from extproc.admission import AdmissionControl, Waiter, derived_limit
from extproc.config import load_snapshot
from extproc.config.schema import PoolAdmission
from extproc.exchange import Exchange, Identity
from extproc.picker import EngineLoad
from extproc.provider_quota import quota_charges
from extproc.reservation import Held
from extproc.stages.admit import Admission
from extproc.store import PERIOD_MS, RateCharge, Settlement, Store, queue_keys, quota_key, returned_ms, slots_key
from tests.conftest import POLICY, valkey_url
from tests.unit.test_store import reservation

CEILING = PoolAdmission(max_in_flight=64, waiting_per_engine=1.0, kv_usage_limit=0.9)


def load(waiting: float, running: float, kv: float) -> EngineLoad:
    return EngineLoad(waiting=waiting, running=running, kv_usage=kv, at=0.0)


@pytest.mark.parametrize(("loads", "bound"), [
    ((), 64),  # no fresh reading: the ceiling alone
    ((load(0, 10, 0.3), load(1, 12, 0.4)), 64),  # a queue they tolerate (1 each)
    ((load(3, 10, 0.3), load(2, 12, 0.4)), 24),  # they queue: what they run, plus what they tolerate
    ((load(0, 20, 0.95), load(0, 30, 0.9)), 52),  # the KV caches nearly full (mean 0.925)
    ((load(90, 200, 0.99), load(90, 200, 0.99)), 64),  # never above the ceiling
    ((load(5, 0, 1.0),), 1),  # never below one
])
def test_the_bound_follows_the_engines_signals_under_the_ceiling(loads: tuple[EngineLoad, ...], bound: int) -> None:
    assert derived_limit(CEILING, loads) == bound


def run(fn: Callable[[Store, str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        store = Store(valkey_url())
        try:
            return await fn(store, f"p{uuid.uuid4().hex[:8]}")  # every test its own pool: its own keys
        finally:
            await store.close()
    return asyncio.run(main())


NOW = 1_000_000_000


def test_a_slot_while_the_pool_holds_fewer_than_its_bound_and_nobody_waits() -> None:
    async def go(store: Store, pool: str) -> list[Any]:
        a = [await store.admit(pool, f"r{i}", NOW, NOW + 60_000, 2, 0, "t", 1.0) for i in range(3)]
        again = await store.admit(pool, "r0", NOW, NOW + 60_000, 2, 0, "t", 1.0)  # a retried call
        await store.release_slot(pool, "r0")
        after = await store.admit(pool, "r2", NOW, NOW + 60_000, 2, 0, "t", 1.0)
        return [a, again, after]

    (first, second, third), again, after = run(go)
    assert first == (True, None) and second == (True, None) and third == (False, None)  # may not wait: refused
    assert again == (True, None) and after == (True, None)


def test_a_crashed_gateway_s_slots_end_with_their_leases() -> None:
    async def go(store: Store, pool: str) -> tuple[Any, Any]:
        await store.admit(pool, "held", NOW, NOW + 1_000, 1, 0, "t", 1.0)
        before = await store.admit(pool, "next", NOW + 999, NOW + 60_000, 1, 0, "t", 1.0)
        after = await store.admit(pool, "next", NOW + 1_001, NOW + 60_000, 1, 0, "t", 1.0)
        return before, after

    assert run(go) == ((False, None), (True, None))


def order_of_admission(arrivals: list[tuple[str, int, float]], slots_freed: int) -> list[str]:
    """Every arrival (tenant, priority, weight) waits in a full pool of one slot; then slots free one by
    one, and each time every waiter asks (as their workers do): who is admitted, in order."""
    async def go(store: Store, pool: str) -> list[str]:
        await store.admit(pool, "holder", NOW, NOW + 600_000, 1, 0, "x", 1.0)
        rids = []
        for i, (tenant, prio, weight) in enumerate(arrivals):
            rid = f"{tenant}-{i}"
            ok, start = await store.admit(pool, rid, NOW, NOW + 600_000, 1, prio, tenant, weight, NOW + 60_000)
            assert not ok and start is not None
            rids.append((rid, prio, tenant, weight))
        out: list[str] = []
        holder = "holder"
        for _ in range(slots_freed):
            await store.release_slot(pool, holder)
            for rid, prio, tenant, weight in rids:
                if rid not in out and (await store.admit(pool, rid, NOW, NOW + 600_000, 1, prio, tenant, weight))[0]:
                    out.append(rid)
                    holder = rid
                    break
        return out

    return [rid.split("-")[0] for rid in run(go)]


def test_within_a_priority_equal_weights_alternate_however_many_one_tenant_sends() -> None:
    arrivals = [("a", 0, 1.0)] * 10 + [("b", 0, 1.0)] * 3
    assert order_of_admission(arrivals, 8) == ["a", "b", "a", "b", "a", "b", "a", "a"]


def test_a_tenant_of_weight_two_is_admitted_twice_as_often() -> None:
    arrivals = [("a", 0, 2.0)] * 8 + [("b", 0, 1.0)] * 8
    assert Counter(order_of_admission(arrivals, 9)) == {"a": 6, "b": 3}


def test_a_higher_priority_waiter_goes_first_whenever_it_came() -> None:
    arrivals = [("batch", 0, 1.0)] * 3 + [("chat", 10, 1.0)] * 2
    assert order_of_admission(arrivals, 5) == ["chat", "chat", "batch", "batch", "batch"]


def test_a_waiter_that_leaves_or_whose_worker_died_is_out_of_the_queue() -> None:
    async def go(store: Store, pool: str) -> list[Any]:
        await store.admit(pool, "holder", NOW, NOW + 600_000, 1, 0, "x", 1.0)
        await store.admit(pool, "left", NOW, NOW + 600_000, 1, 0, "t", 1.0, NOW + 60_000)
        await store.admit(pool, "dead", NOW, NOW + 600_000, 1, 0, "u", 1.0, NOW + 1_000)
        await store.admit(pool, "last", NOW, NOW + 600_000, 1, 0, "v", 1.0, NOW + 60_000)
        await store.leave(pool, "left")
        await store.release_slot(pool, "holder")
        # "dead" waits until NOW + 1000 and is first then; after that, "last" is.
        return [await store.admit(pool, "last", NOW + 500, NOW + 600_000, 1, 0, "v", 1.0),
                await store.admit(pool, "last", NOW + 1_001, NOW + 600_000, 1, 0, "v", 1.0)]

    assert run(go) == [(False, 0.0), (True, None)]


def test_the_queue_s_keys_share_the_pool_s_slot() -> None:
    tags = {k.split("{")[1].split("}")[0] for k in [slots_key("p"), *queue_keys("p")]}
    assert tags == {"admit:p"}
    assert {k.split("{")[1].split("}")[0] for k in (quota_key("d", "rpm"), quota_key("d", "tpm", "acme"))} == {"pq:d"}


def test_a_provider_quota_and_a_tenant_s_share_are_charged_together_or_not_at_all() -> None:
    dep = f"d{uuid.uuid4().hex[:8]}"

    async def go(store: Store, _: str) -> list[Any]:
        def charges(tenant: str, share: float) -> list[RateCharge]:
            return quota_charges(dep, 10, 10_000, share, tenant, 100)
        out = [await store.reserve_quota(NOW, charges("small", 0.2)) for _ in range(3)]  # its share: 2 a minute
        out += [await store.reserve_quota(NOW, charges("big", 1.0)) for _ in range(9)]  # the rest of the 10
        return out

    out = run(go)
    assert [ok for ok, _ in out[:3]] == [True, True, False]
    assert [ok for ok, _ in out[3:]] == [True] * 8 + [False]  # 2 + 8 = the deployment's 10
    assert out[2][1] > 0 and out[-1][1] > 0  # how long until there is room: Retry-After


def test_settlement_gives_back_what_a_request_did_not_use_of_a_provider_quota() -> None:
    dep = f"d{uuid.uuid4().hex[:8]}"
    charges = quota_charges(dep, 100, 6_000, 1.0, "t", 1_000)
    hint = orjson.loads(orjson.dumps({"q": [c.encode() for c in charges]}))
    # 200 of the 1000 reserved tokens used: 800 tokens' worth of milliseconds back; released: all of it.
    assert returned_ms(hint, 200, False) == [(quota_key(dep, "tpm"), 800 * PERIOD_MS / 6_000)]
    assert returned_ms(hint, 0, True) == [(quota_key(dep, "rpm"), PERIOD_MS / 100),
                                          (quota_key(dep, "tpm"), 1_000 * PERIOD_MS / 6_000)]

    async def go(store: Store, _: str) -> tuple[float, float]:
        await store.reserve_quota(NOW, charges)
        r = redis.Redis.from_url(valkey_url(), decode_responses=True)
        before = float(r.get(quota_key(dep, "tpm")) or 0)
        t = f"t{uuid.uuid4().hex[:8]}"
        held = reservation(t, "rid", tokens=1_000, limit_tokens=None)
        assert (await store.reserve(held)).outcome == "ok"
        settled_hint = orjson.dumps({**orjson.loads(held.hint), **hint}).decode()
        await store.settle(Settlement(t, "rid", {"termination": "complete"}, 10, 200, hint=settled_hint))
        return before, float(r.get(quota_key(dep, "tpm")) or 0)

    before, after = run(go)
    assert before - after == pytest.approx(800 * PERIOD_MS / 6_000)


def test_a_hint_names_what_settlement_gives_back_and_loses_what_is_taken_out() -> None:
    held = Held(10, 4, 2, 2, 1, "v1", '{"b":["k"]}', False)
    with_slot = held.with_hint(a="llmgw:{admit:p}:slots")
    assert orjson.loads(with_slot.hint) == {"b": ["k"], "a": "llmgw:{admit:p}:slots"}
    assert orjson.loads(with_slot.with_hint(a=None).hint) == {"b": ["k"]}
    assert with_slot.micros == held.micros and held.hint == '{"b":["k"]}'  # a new value; the old one unchanged


def test_a_slot_asked_for_a_pool_the_plan_does_not_start_at_goes_back() -> None:
    """The reservation's write asked the route's first candidate's pool for a slot (stages/budget.py),
    but the plan starts at a hosted candidate (the pool's did not qualify): admission gives the slot
    back at once and takes it out of the hint, instead of holding it while the other candidate serves."""
    snap = load_snapshot(POLICY)

    async def go(store: Store, pool: str) -> tuple[int, dict[str, Any]]:
        control = AdmissionControl(store)
        gate = control.gate(pool, PoolAdmission(max_in_flight=4))
        assert gate is not None
        w = Waiter.of(snap.gateway, "read_only_chat", "acme", "r1", int(time.time() * 1000) + 60_000)
        assert (await gate.ask(w))[0]  # the slot the reservation's write was granted
        held = Held(100, 64, 32, 32, 1, "v1", orjson.dumps({"b": [], "a": slots_key(pool)}).decode(), False)
        ex = Exchange(snapshot=snap, route=snap.routes["chat-fallback"], request_id="r1", held=held,
                      identity=Identity("acme", "k1", "api_key"), early_slot=(pool, True),
                      candidates=(snap.deployments["demo-anthropic"],))
        ex.plan = "the plan"  # admission reads only that there is one when it starts at candidate 0
        await Admission(control).run(ex)
        for _ in range(50):  # given back in the background
            if not await store.client.zcard(slots_key(pool)):
                break
            await asyncio.sleep(0.01)
        assert ex.held is not None
        return await store.client.zcard(slots_key(pool)), orjson.loads(ex.held.hint)

    held_slots, hint = run(go)
    assert held_slots == 0
    assert "a" not in hint and "q" in hint  # the hosted candidate's quota is held instead


def test_a_waiter_is_admitted_when_the_engines_queue_drains_with_no_other_request() -> None:
    """The bound is read from the engines' readings at every ask, a waiting request's polls included: a
    lone waiter queued while the engines queued is admitted once they drain, without another decision
    refreshing the gate (a bound kept from the last decision held it to its TTL and shed it)."""
    snap = load_snapshot(POLICY)
    readings = {"now": (load(5, 1, 0.1),)}  # one engine, queueing: the bound is what it runs plus 1

    async def go(store: Store, pool: str) -> tuple[int, bool, float]:
        control = AdmissionControl(store, lambda p: readings["now"] if p == pool else ())
        gate = control.gate(pool, PoolAdmission(max_in_flight=8))
        assert gate is not None
        lease = int(time.time() * 1000) + 60_000
        for rid in ("h1", "h2"):  # the two in flight fill the derived bound of 2
            assert (await gate.ask(Waiter.of(snap.gateway, "read_only_chat", "acme", rid, lease)))[0]
        bound = gate.limit()
        w = Waiter.of(snap.gateway, "read_only_chat", "acme", "w", lease)
        ok, start = await gate.ask(w, int(time.time() * 1000) + 5_000)
        assert not ok and start is not None
        w.start = start
        assert gate.wait(w)
        await asyncio.sleep(0.2)
        still_waiting = not w.future.done()
        readings["now"] = (load(0, 2, 0.1),)  # the engine's queue drained: the ceiling again
        sent = time.monotonic()
        await asyncio.wait_for(w.future, 2.0)
        return bound, still_waiting, time.monotonic() - sent

    bound, still_waiting, admitted_after = run(go)
    assert bound == 2 and still_waiting
    assert admitted_after < 0.5, admitted_after


def sliced_gate(store: Store, pool: str, limit: int = 64, slice_ms: int = 60_000) -> Any:
    gate = AdmissionControl(store).gate(pool, PoolAdmission(max_in_flight=limit))
    assert gate is not None
    gate.slicing = (4, slice_ms)  # as store.slice_requests and slice_ms set it
    return gate


def waiter(rid: str) -> Waiter:
    return Waiter.of(load_snapshot(POLICY).gateway, "read_only_chat", "acme", rid, int(time.time() * 1000) + 5_000)


def test_a_worker_admits_from_its_slice_of_a_pools_slots_and_settlement_gives_each_back() -> None:
    """Four slots taken at once (one store round trip), four requests admitted from them, the fifth
    takes the next slice; each request's hint names the member it holds, and settling it frees that
    member; the slice's unused slots go back when its time is up."""
    async def go(store: Store, pool: str) -> tuple[list[int], dict[str, Any], int, int]:
        gate = sliced_gate(store, pool)
        held = []
        for i in range(5):
            assert (await gate.ask(waiter(f"r{i}")))[0]
            held.append(await store.client.zcard(slots_key(pool)))
        hint = gate.slot_hint("r0")
        await store.settle_many([Settlement("t", "r0", {"settlement": "released"}, 0, 0,
                                            hint=orjson.dumps({"b": [], **hint}).decode())])
        after_settle = await store.client.zcard(slots_key(pool))
        assert gate._slice is not None
        gate._end(gate._slice)  # its time is up: 3 of the second slice's 4 unused
        for _ in range(50):
            if await store.client.zcard(slots_key(pool)) == 4:
                break
            await asyncio.sleep(0.01)
        return held, hint, after_settle, await store.client.zcard(slots_key(pool))

    held, hint, after_settle, at_end = run(go)
    assert held == [4, 4, 4, 4, 8]  # one slice of four, then a second
    assert hint["a"].endswith(":slots") and hint["m"].startswith("~") and hint["m"].endswith(":1")
    assert after_settle == 7 and at_end == 4  # r0's member freed; the second slice's 3 unused given back


def test_no_slice_of_a_pools_slots_while_anyone_waits_nor_of_its_last_room() -> None:
    async def go(store: Store, pool: str) -> tuple[int, int]:
        gate = sliced_gate(store, pool, limit=16)
        now = int(time.time() * 1000)
        far = now + 600_000
        # 16 slots: 1/8 of the free ones is 2, a slice; 12 held by others leave 4: no slice.
        for i in range(12):
            await store.admit(pool, f"other{i}", now, far, 16, 0, "x", 1.0)
        assert await store.take_slots(pool, "a", now, far, 4, 16, 8) == 0
        assert (await gate.ask(waiter("alone")))[0]  # admitted by the store on its own
        for i in range(3):
            await store.admit(pool, f"fill{i}", now, far, 16, 0, "x", 1.0)
        queued = await store.admit(pool, "queued", now, far, 16, 0, "x", 1.0, far)
        assert not queued[0] and queued[1] is not None  # full: it waits
        await store.release_slot(pool, *(f"other{i}" for i in range(12)), *(f"fill{i}" for i in range(3)),
                                 gate._members.get("alone", "alone"))
        waiting = await store.take_slots(pool, "b", now, far, 4, 16, 8)
        return waiting, await store.client.zcard(slots_key(pool))

    assert run(go) == (0, 0)  # all 16 free, room for a slice of 2, but someone waits: no slice


def test_a_slice_of_slots_whose_worker_died_ends_at_its_expiry() -> None:
    async def go(store: Store, pool: str) -> tuple[Any, Any]:
        now = int(time.time() * 1000)
        assert await store.take_slots(pool, "dead", now, now + 1_000, 4, 4 * 8, 8) == 4
        before = await store.admit(pool, "x", now + 999, now + 60_000, 4, 0, "t", 1.0)
        after = await store.admit(pool, "x", now + 1_001, now + 60_000, 4, 0, "t", 1.0)
        return before, after

    assert run(go) == ((False, None), (True, None))


def test_a_request_cancelled_while_another_takes_the_slice_leaves_the_gate_serving() -> None:
    """Requests that wait while another takes the pool's slot slice share one future. Envoy cancels a
    decision it stopped waiting for: that cancellation must not cancel the shared future, or the taker
    fails and every later request meets a cancelled take (the worker that served nothing more under a
    load of 32 in the benchmark)."""
    async def go(store: Store, pool: str) -> list[bool]:
        gate = sliced_gate(store, pool)
        real = store.take_slots
        release = asyncio.Event()

        async def slow_take(*args: Any) -> int:
            await release.wait()
            return await real(*args)
        store.take_slots = slow_take  # type: ignore[method-assign]
        taker = asyncio.ensure_future(gate.ask(waiter("taker")))
        await asyncio.sleep(0.01)
        cancelled = asyncio.ensure_future(gate.ask(waiter("gone")))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # its client went away while the slice was being taken
        await asyncio.sleep(0.01)
        release.set()
        first = (await asyncio.wait_for(taker, 5))[0]
        store.take_slots = real  # type: ignore[method-assign]
        later = [(await asyncio.wait_for(gate.ask(waiter(f"later{i}")), 5))[0] for i in range(6)]
        return [first, *later]

    assert run(go) == [True] * 7
