"""One take in flight per key, shared (extproc/single_flight.py): a waiter cancelled while it waits
(Envoy stopped waiting for its decision) ends only its own wait."""

from __future__ import annotations

import asyncio

import pytest

from extproc.single_flight import SingleFlight


def test_a_cancelled_waiter_ends_only_its_own_wait() -> None:
    async def go() -> tuple[list[str], bool]:
        flights, release, seen = SingleFlight(), asyncio.Event(), []

        async def take() -> None:
            with flights.taking("k"):
                await release.wait()
                seen.append("taken")

        async def wait(name: str) -> None:
            assert await flights.joined("k")
            seen.append(name)

        taker = asyncio.ensure_future(take())
        await asyncio.sleep(0)
        gone, stays = asyncio.ensure_future(wait("gone")), asyncio.ensure_future(wait("stays"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(asyncio.gather(taker, stays), 5)
        with pytest.raises(asyncio.CancelledError):
            await gone
        return seen, await flights.joined("k")  # nothing in flight any more

    assert asyncio.run(go()) == (["taken", "stays"], False)


def test_a_failed_take_ends_the_wait_too() -> None:
    async def go() -> bool:
        flights = SingleFlight()

        async def take() -> None:
            with flights.taking():
                await asyncio.sleep(0.01)
                raise ConnectionError("the store")

        taker = asyncio.ensure_future(take())
        await asyncio.sleep(0)
        joined = await asyncio.wait_for(flights.joined(), 5)
        with pytest.raises(ConnectionError):
            await taker
        return joined

    assert asyncio.run(go())
