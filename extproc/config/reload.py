"""Hot reload: watch the policy directory (and take SIGHUP), build a new revision off to the side,
and swap it in only when it loads, compiles and (optionally) passes its policy tests. A refused
revision is logged and reported on the status endpoint; the last known good one keeps serving
(invariant 12). Requests already admitted keep the snapshot they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.config.earned import evidence_dirs
from extproc.config.loader import ConfigError, Snapshot, load_snapshot
from extproc.config.policy_tests import run_isolated
from extproc.metrics import count_reload
from extproc.replay import Sealer
from extproc.secrets import SecretUnavailable

log = logging.getLogger("llmgw.reload")
POLL_S = 1.0


@dataclass(frozen=True)
class Live:
    """What a request is served under: one revision and the secrets resolved for it."""

    snapshot: Snapshot
    cache_salts: dict[str, str]
    sealer: Sealer = field(default_factory=lambda: Sealer(None))  # idempotent answers kept for replay
    # Each deployment's credential, resolved from its reference when the revision is loaded (at start
    # and on every reload), never per request; a reference that does not resolve leaves its
    # deployment unaddressable (the attempt is refused, naming the reference) without stopping the rest.
    credentials: dict[str, str] = field(default_factory=dict)
    credential_errors: dict[str, str] = field(default_factory=dict)
    shadow_key: bytes = b""  # signs and checks shadow grants (extproc/shadow.py); empty: none accepted
    region: str = ""  # where this gateway runs (ext_proc --region): residency is enforced for it


def directory_signature(root: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and mtimes of every file of the policy and of its earned evidence kept elsewhere
    (extproc/config/earned.py): cheap enough to poll every second."""
    out = []
    for folder in (root, *(d for d in evidence_dirs(root) if not d.is_relative_to(root.resolve()))):
        for p in sorted(folder.rglob("*")):
            try:
                st = p.stat()
            except OSError:
                continue
            if p.is_file():
                out.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass
class Reloader:
    directory: Path
    build: Callable[[Snapshot], Live]  # resolves secrets; raises SecretUnavailable
    live: Live
    run_tests: bool = False
    status: dict[str, Any] = field(default_factory=dict)
    _signature: tuple[tuple[str, int, int], ...] = ()

    def __post_init__(self) -> None:
        self._signature = directory_signature(self.directory)
        self.status = {"revision": self.live.snapshot.revision, "region": self.live.region, "loaded_at": time.time(),
                       "last_attempt": None, "last_error": None, "reloads": 0, "refused": 0}

    def reload(self, reason: str) -> bool:
        """Try the directory as it is now; True when a new revision took over."""
        self._signature = directory_signature(self.directory)
        self.status["last_attempt"] = time.time()
        failed: list[str] = []
        try:
            snapshot = load_snapshot(self.directory)
            if self.run_tests:
                report = run_isolated(snapshot.rego, snapshot.policy_data)
                failed = report.load_errors + [r.name for r in report.results if not r.passed]
                if failed:
                    raise ConfigError([])  # reported below with the failing rules
            live = self.build(snapshot)
        except ConfigError as e:
            problems = [str(i) for i in e.issues] or [f"policy tests failed: {', '.join(failed)}"]
            return self._refuse(reason, problems)
        except SecretUnavailable as e:
            return self._refuse(reason, [str(e)])
        if snapshot.revision == self.live.snapshot.revision:
            self.status["last_error"] = None
            return False
        old = self.live.snapshot.gateway
        if (old.envoy, old.pools, old.tls) != (snapshot.gateway.envoy, snapshot.gateway.pools, snapshot.gateway.tls):
            # Listeners, clusters and certificates are Envoy's: they change with a re-render.
            log.warning("envoy, pools or tls changed: run `llmgw envoy render` and restart Envoy for them "
                        "to take effect; policy, routes and keys take effect now")
        log.info("config reloaded (%s): revision %s replaces %s", reason, snapshot.revision,
                 self.live.snapshot.revision)
        self.live = live
        self.status.update(revision=snapshot.revision, loaded_at=time.time(), last_error=None,
                           reloads=self.status["reloads"] + 1)
        count_reload(True)
        return True

    def _refuse(self, reason: str, problems: list[str]) -> bool:
        self.status.update(last_error=problems, refused=self.status["refused"] + 1)
        count_reload(False)
        log.error("config reload (%s) refused; revision %s keeps serving:\n  %s", reason,
                  self.live.snapshot.revision, "\n  ".join(problems))
        return False

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
            if not stop.is_set() and directory_signature(self.directory) != self._signature:
                self.reload("files changed")
