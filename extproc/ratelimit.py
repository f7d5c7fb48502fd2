"""Log lines a client can cause, bounded: at most one per interval per call site, with a count of
what was left out, so nobody without a credential can flood the log (or the disk under it)."""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = 10.0):
        self.logger = logger
        self.every_s = every_s
        self._last = -float("inf")
        self._suppressed = 0

    def _allowed(self) -> int | None:
        """None while quiet; else how many lines were left out since the last one."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._suppressed += 1
            return None
        self._last, left_out, self._suppressed = now, self._suppressed, 0
        return left_out

    def info(self, msg: str, *args: Any) -> None:
        self._emit(logging.INFO, msg, args, False)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit(logging.WARNING, msg, args, False)

    def error(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        self._emit(logging.ERROR, msg, args, exc_info)

    def _emit(self, level: int, msg: str, args: tuple[Any, ...], exc_info: bool) -> None:
        left_out = self._allowed()
        if left_out is None:
            return
        if left_out:
            msg += f" ({left_out} similar line(s) left out in the last {self.every_s:.0f}s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
