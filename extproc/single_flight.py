"""One store call in flight per key, shared by the requests that come while it runs (taking a slice: one
take serves them all, and they then admit from what it took)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Iterator


class SingleFlight:
    """The takes in flight, by key. A request waiting for one waits through a shield: Envoy cancels a
    decision it stopped waiting for, and that cancellation must end only that request's wait - never
    the take, nor the others' wait. (Awaiting the shared future itself cancelled it for everyone: the
    taker then failed to mark it done, its mark stayed, and every later request met a cancelled take -
    a worker that served nothing more under load.)"""

    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Future[None]] = {}

    async def joined(self, key: Hashable = None) -> bool:
        """Whether a take of `key` was in flight; if so, returns once it has ended (however it ended)."""
        running = self._running.get(key)
        if running is None:
            return False
        await asyncio.shield(running)
        return True

    @contextlib.contextmanager
    def taking(self, key: Hashable = None) -> Iterator[None]:
        """This request's take of `key`: the others wait for it until the block ends."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._running[key] = done
        try:
            yield
        finally:
            del self._running[key]
            done.set_result(None)
