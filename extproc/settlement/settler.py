"""Settlements written to the store: queued by the filters and the access log, sent in one round trip
per batch (each still its own atomic script), sent again while the store does not answer."""

from __future__ import annotations

import asyncio
import logging

from extproc.ratelimit import RateLimitedLog
from extproc.settlement.observe import Observe
from extproc.store import Settlement, Store, StoreUnavailable

log = logging.getLogger("llmgw.settlement")
store_down = RateLimitedLog(log)  # per-request lines while the store is down: bounded
BATCH_MAX = 128
BATCH_WAIT_S = 0.002
RETRY_EVERY_S, RETRY_FOR_S = 0.5, 60.0  # settlements the store could not take, sent again


class Settler:
    """Settlements queued by the filters and the access log, sent in one store round trip for every
    batch gathered within BATCH_WAIT_S (each is still its own atomic script). `submit` returns a
    future that says whether its batch was written, for the callers that must wait for it. A batch
    the store could not take is sent again every RETRY_EVERY_S for RETRY_FOR_S, so a store that comes
    back settles to actual usage (settling twice is harmless: the first wins); after that the lease
    expires and the sweeper charges in full."""

    def __init__(self, store: Store):
        self.store = store
        # (settlement, its future, when it first failed: 0.0 = never, what to observe once it is written)
        self._queue: list[tuple[Settlement, asyncio.Future[bool], float, Observe | None]] = []
        self._flushing: asyncio.Task[None] | None = None

    def submit(self, item: Settlement, observe: Observe | None = None) -> asyncio.Future[bool]:
        """`observe` runs once if this settlement is the one the store keeps (the metrics)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((item, done, 0.0, observe))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        return done

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                if len(self._queue) < BATCH_MAX:
                    await asyncio.sleep(BATCH_WAIT_S)
                batch, self._queue = self._queue[:BATCH_MAX], self._queue[BATCH_MAX:]
                first: list[bool] = []
                try:
                    first = await self.store.settle_many([item for item, _, _, _ in batch])
                    written = True
                except StoreUnavailable:
                    written = False
                    now = loop.time()
                    kept = [(item, done, failed or now, observe) for item, done, failed, observe in batch
                            if now - (failed or now) < RETRY_FOR_S]
                    if len(kept) < len(batch):
                        log.error("%d settlement(s) not written for %.0fs (store unavailable); the sweeper "
                                  "will charge them when their leases expire", len(batch) - len(kept), RETRY_FOR_S)
                    self._queue = kept + self._queue
                except Exception:  # a settlement that cannot be written at all (a bug): never the whole queue
                    written = False
                    log.exception("%d settlement(s) could not be written; the sweeper will charge them when "
                                  "their leases expire", len(batch))
                for _, done, _, _ in batch:
                    if not done.done():
                        done.set_result(written)
                # Metrics and spans of the settlements the store kept; what they raise never holds up a
                # settlement (their callers are already answered).
                for (_, _, _, observe), won in zip(batch, first, strict=False):
                    if won and observe is not None:
                        try:
                            observe()
                        except Exception:
                            log.exception("observing a settlement failed")
                if not written and self._queue:
                    await asyncio.sleep(RETRY_EVERY_S)
        finally:
            self._flushing = None
