"""The Settler's observers (metrics and the request's span): run once, for the settlements the store
kept, after their callers are answered - an observer that fails never holds a settlement up."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.settlement.settler import Settler
from extproc.store import Settlement


def settled(rid: str) -> Settlement:
    return Settlement("acme", rid, "", {}, 0, 0)


class Store:
    """Keeps the first settlement of each request, as the settle script does."""

    def __init__(self) -> None:
        self.settled: set[str] = set()

    async def settle_many(self, items: list[Any]) -> list[bool]:
        won = []
        for item in items:  # one script call after another, as the pipeline runs them
            won.append(item.rid not in self.settled)
            self.settled.add(item.rid)
        return won


def test_observers_run_for_kept_settlements_only_and_a_failing_one_holds_nothing_up() -> None:
    seen: list[str] = []

    def broken() -> None:
        raise RuntimeError("an observer's bug")

    async def run() -> list[bool]:
        settler = Settler(Store())  # type: ignore[arg-type]
        first = settler.submit(settled("r1"), broken)
        again = settler.submit(settled("r1"), lambda: seen.append("r1 again"))  # settled already: not observed
        other = settler.submit(settled("r2"), lambda: seen.append("r2"))
        return list(await asyncio.wait_for(asyncio.gather(first, again, other), 5))

    assert asyncio.run(run()) == [True, True, True]  # every caller answered, the broken observer's too
    assert seen == ["r2"]


class Unwritable(Store):
    """A settlement the store client cannot even encode (a bug) fails its whole batch."""

    async def settle_many(self, items: list[Any]) -> list[bool]:
        if any(item.rid == "bad" for item in items):
            raise TypeError("Dict key must be str")
        return await super().settle_many(items)


def test_a_batch_that_cannot_be_written_fails_alone_and_the_settler_goes_on() -> None:
    """Found when a settlement carried an enum as a key: the flush task died, every caller of its batch
    waited forever and nothing queued after it was written. Now the batch answers False (the sweeper
    charges its leases) and what follows is settled."""
    async def run() -> tuple[list[bool], bool]:
        settler = Settler(Unwritable())  # type: ignore[arg-type]
        batch = [settler.submit(settled(rid)) for rid in ("r1", "bad")]
        answers = list(await asyncio.wait_for(asyncio.gather(*batch), 5))
        later = await asyncio.wait_for(settler.submit(settled("r3")), 5)
        return answers, later

    assert asyncio.run(run()) == ([False, False], True)
