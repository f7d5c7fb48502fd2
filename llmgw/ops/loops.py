"""Supervised loops: the checks that must fire without an operator remembering to run them, each on its
own thread at the interval the configuration gives (gateway.yaml `loops`), run by `llmgw up`.

A loop whose run raises is not stopped: the error is its state until its next run. Each loop's state
(runs, last run, last outcome or error) is written to one JSON file after every run; every worker
serves it in its `GET /status` (`loops`), so an operator reads it where they read the revision.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("llmgw.loops")


@dataclass
class LoopState:
    interval_s: float
    runs: int = 0
    last_run: float | None = None  # unix seconds
    last_outcome: str = ""
    error: str = ""


class Loops:
    def __init__(self, state_file: Path) -> None:
        self.state_file = state_file
        self.states: dict[str, LoopState] = {}
        self._jobs: dict[str, Callable[[], str]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def add(self, name: str, interval_s: float, run: Callable[[], str]) -> None:
        """`run` every `interval_s` seconds (the first at once); it returns its outcome in words."""
        self.states[name] = LoopState(interval_s)
        self._jobs[name] = run

    def start(self) -> Loops:
        self._write()
        for name in self._jobs:
            t = threading.Thread(target=self._loop, args=(name,), name=f"loop-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def run_now(self, name: str) -> LoopState:
        """One run of `name`, its state recorded (what the thread does each interval)."""
        state = self.states[name]
        try:
            outcome, error = self._jobs[name](), ""
        except Exception as e:  # a loop outlives its runs' failures: the error is its state
            log.exception("loop %s failed", name)
            outcome, error = "", f"{type(e).__name__}: {e}"
        with self._lock:
            state.runs += 1
            state.last_run = time.time()
            state.last_outcome, state.error = outcome, error
            self._write()
        return state

    def _loop(self, name: str) -> None:
        while not self._stop.is_set():
            self.run_now(name)
            self._stop.wait(self.states[name].interval_s)

    def _write(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: asdict(s) for n, s in self.states.items()}))
        os.replace(tmp, self.state_file)
