"""The Settler's observers (metrics and the request's span): run once, for the settlements the store
kept, after their callers are answered - an observer that fails never holds a settlement up."""

from __future__ import annotations

import asyncio
from typing import Any

from extproc.settlement import Settler


class Store:
    """Keeps the first settlement of each request, as the settle script does."""

    def __init__(self) -> None:
        self.settled: set[str] = set()

    async def settle_many(self, items: list[Any]) -> list[bool]:
        won = []
        for item in items:  # one script call after another, as the pipeline runs them
            won.append(item[1] not in self.settled)
            self.settled.add(item[1])
        return won


def test_observers_run_for_kept_settlements_only_and_a_failing_one_holds_nothing_up() -> None:
    seen: list[str] = []

    def broken() -> None:
        raise RuntimeError("an observer's bug")

    async def run() -> list[bool]:
        settler = Settler(Store())  # type: ignore[arg-type]
        first = settler.submit(("acme", "r1"), broken)
        again = settler.submit(("acme", "r1"), lambda: seen.append("r1 again"))  # settled already: not observed
        other = settler.submit(("acme", "r2"), lambda: seen.append("r2"))
        return list(await asyncio.wait_for(asyncio.gather(first, again, other), 5))

    assert asyncio.run(run()) == [True, True, True]  # every caller answered, the broken observer's too
    assert seen == ["r2"]
