"""Keeps the gateway's processes running: `llmgw up` polls this while it runs.

A child that exits (an ext_proc worker, an engine, the store, Envoy) is started again on the same
ports after a backoff - 0.5 s, doubling with each exit in the window, at most 8 s - and the reason
and its log are printed. One that is alive but misses its health probe (an ext_proc worker whose
event loop is stuck: Envoy's own health check has already taken it out of rotation)
`probe_failures` times in a row, `probe_every_s` apart, is killed, and so started again the same
way (a process just started has `start_grace_s` to answer its first probe). Envoy keeps answering
while an ext_proc worker is down (503 policy_unavailable, or another worker takes the decisions);
the store keeps its data (append-only file); settlements that failed while it was down are sent
again when it is back. One child exiting more than `max_restarts` times within `window_s` is a
crash loop: supervision gives up, and `llmgw up` stops everything with an error naming it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

from llmgw.local.procs import Child


class CrashLoop(Exception):
    """A child exited too often: the gateway stops rather than flap."""


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class _Watch:
    exits: deque[float] = field(default_factory=deque)
    restart_at: float | None = None  # when the exited child is started again
    probed_at: float = 0.0  # when its health probe last ran
    missed: int = 0  # health probes missed in a row
    pid: int | None = None  # the process probed; a new one is given time to start
    since: float = 0.0  # when that process was first seen
    answered: bool = False  # whether that process has answered a probe yet


class Supervisor:
    def __init__(self, children: Callable[[], Iterable[Child]], out: TextIO = sys.stderr,
                 max_restarts: int = 5, window_s: float = 60.0, first_backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, clock: Callable[[], float] = time.monotonic,
                 probe_every_s: float = 1.0, probe_failures: int = 3, start_grace_s: float = 30.0):
        self.children = children
        self.out = out
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.probe_every_s = probe_every_s
        self.probe_failures = probe_failures
        self.start_grace_s = start_grace_s
        self.restarts = 0  # in all, for status and tests
        self._watch: dict[str, _Watch] = {}

    def poll(self) -> None:
        """Notice exits, start what is due again; raise CrashLoop when a child loops."""
        now = self.clock()
        for child in self.children():
            w = self._watch.setdefault(child.name, _Watch())
            if child.alive:
                self._probe(child, w, now)
                continue
            if w.restart_at is None:
                self._noticed(child, w, now)
            elif now >= w.restart_at:
                w.restart_at = None
                child.start()
                self.restarts += 1
                self._say(f"{child.name} started again (pid {child.proc.pid if child.proc else '?'})")

    def _probe(self, child: Child, w: _Watch, now: float) -> None:
        """A running child's health probe, every probe_every_s: after probe_failures misses in a row it
        is killed (SIGKILL: it may not be able to take a gentler signal), and its exit restarts it."""
        if child.probe is None or now - w.probed_at < self.probe_every_s:
            return
        pid = child.proc.pid if child.proc is not None else None
        if pid != w.pid:  # started (again): misses count once it answered, or its start took too long
            w.pid, w.since, w.answered, w.missed = pid, now, False, 0
        w.probed_at = now
        if child.probe():
            w.missed, w.answered = 0, True
            return
        if not w.answered and now - w.since < self.start_grace_s:
            return
        w.missed += 1
        if w.missed >= self.probe_failures:
            w.missed = 0
            self._say(f"{child.name} did not answer its health probe {self.probe_failures} times in a row; "
                      "killing it")
            child.signal(signal.SIGKILL)
            if child.proc is not None:
                child.proc.wait(5)

    def _noticed(self, child: Child, w: _Watch, now: float) -> None:
        w.exits.append(now)
        while w.exits and now - w.exits[0] > self.window_s:
            w.exits.popleft()
        reason = exit_reason(child.proc.returncode if child.proc else None)
        if len(w.exits) > self.max_restarts:
            raise CrashLoop(f"{child.name} {reason}, its {len(w.exits)}th exit in {self.window_s:.0f}s "
                            f"(see {child.log_path})")
        delay = min(self.max_backoff_s, self.first_backoff_s * 2 ** (len(w.exits) - 1))
        w.restart_at = now + delay
        self._say(f"{child.name} {reason}; starting it again in {delay:.1f}s "
                  f"({len(w.exits)} of {self.max_restarts} exits allowed in {self.window_s:.0f}s; "
                  f"log: {child.log_path})")

    def _say(self, line: str) -> None:
        print(f"llmgw: {line}", file=self.out, flush=True)
