"""Decision ids, the decision log and the policy dry run.

Every authorization decision gets a `decision_id` (a UUID, as OPA gives one); it is in the error body
of a refusal, the access log, the ledger entry and the decision log, so each joins the others.

The decision log (gateway.yaml `decision_log`) has OPA's shape where it fits: decision_id, revision,
path, input (with the configured fields erased and named in `erased`), result, timestamp. The input
never holds message content (stages/authorize.py builds it from who, what class, which route and
which tools), so no entry does either.

A dry run (gateway.yaml `policy_dry_run`) evaluates a candidate policy beside the enforced one for a
share of requests; the candidate's answer is never used. A difference (allow, reasons, obligations,
or one of them failing) is counted and written to the decision log with both decision ids.

Entries are buffered and written in batches (`Store.append_decisions`), so neither the log nor the
dry run adds a store round trip to a request; a batch the store cannot take is dropped and counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.config.policy import Decision
from extproc.store import Store, StoreUnavailable

PATH = "llmgw/authz/decision"
FLUSH_EVERY_S = 0.2
MAX_BUFFERED = 10_000  # entries kept while the store is away; beyond that they are dropped and counted

log = logging.getLogger("llmgw.decisions")


def new_decision_id() -> str:
    return str(uuid.uuid4())


def sampled(request_id: str, share: float) -> bool:
    """Deterministic by request id: a retried request lands on the same side."""
    return share >= 1.0 or (zlib.crc32(request_id.encode()) % 10_000) < share * 10_000


def result_of(decision: Decision | None, error: str = "") -> dict[str, Any]:
    """A decision as the policy returned it (or the error it raised instead)."""
    if decision is None:
        return {"error": error or "no decision"}
    return {"allow": decision.allow, "reasons": list(decision.reasons),
            "obligations": {"redact": list(decision.redact), "record_content": decision.record_content}}


def differences(enforced: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """What differs between two results: `error`, `allow`, `reasons`, `obligations`."""
    if "error" in enforced or "error" in candidate:
        return ["error"] if ("error" in enforced) != ("error" in candidate) else []
    return [k for k in ("allow", "reasons", "obligations") if enforced[k] != candidate[k]]


def erase(doc: dict[str, Any], pointers: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """The input without the fields the pointers name, and the pointers that named something."""
    if not pointers:
        return doc, []
    out = copy.deepcopy(doc)
    erased = []
    for pointer in pointers:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            del node[last]
            erased.append(pointer)
    return out, erased


@dataclass
class DryRunCounts:
    evaluated: int = 0
    differing: int = 0
    failed: int = 0  # the candidate raised where the enforced policy answered, or the other way round
    by_kind: collections.Counter[str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"evaluated": self.evaluated, "differing": self.differing, "failed": self.failed,
                "by_kind": dict(self.by_kind or {})}


class DecisionRecorder:
    """Buffers decision log entries and dry-run counts; a background task writes them in batches."""

    def __init__(self, store: Store | None):
        self.store = store
        # Packed at once: JSON bytes are not tracked by the garbage collector, while 200 ms of buffered
        # dicts made its collections (which walk every tracked object) cost ~45 us per request.
        self.entries: list[tuple[str, bytes]] = []
        self.counts: dict[str, collections.Counter[str]] = {}  # candidate revision -> field -> increment
        self.dry_run: dict[str, DryRunCounts] = {}  # per candidate revision, for GET /status
        self.logged = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def log(self, tenant: str, entry: dict[str, Any]) -> None:
        if len(self.entries) >= MAX_BUFFERED or self.store is None:
            self.dropped += 1
            return
        self.entries.append((tenant, orjson.dumps(entry)))
        self._start()

    def count_dry_run(self, revision: str, kinds: list[str]) -> None:
        c = self.dry_run.setdefault(revision, DryRunCounts(by_kind=collections.Counter()))
        c.evaluated += 1
        pending = self.counts.setdefault(revision, collections.Counter())
        pending["evaluated"] += 1
        if kinds:
            c.differing += 1
            pending["differing"] += 1
            for k in kinds:
                assert c.by_kind is not None
                c.by_kind[k] += 1
                pending[k] += 1
            c.failed += "error" in kinds
        self._start()

    def status(self) -> dict[str, Any]:
        return {"decision_log": {"logged": self.logged, "dropped": self.dropped, "buffered": len(self.entries)},
                "policy_dry_run": {rev: c.as_dict() for rev, c in self.dry_run.items()}}

    def _start(self) -> None:
        if self.store is not None and (self._task is None or self._task.done()):
            with contextlib.suppress(RuntimeError):  # no loop (a stage run outside the server)
                self._task = asyncio.get_running_loop().create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_EVERY_S)
        await self.flush()

    async def flush(self) -> None:
        if self.store is None or not (self.entries or self.counts):
            return
        entries, counts = self.entries, {r: dict(c) for r, c in self.counts.items()}
        self.entries, self.counts = [], {}
        try:
            await self.store.append_decisions(entries, counts)
            self.logged += len(entries)
        except StoreUnavailable:
            self.dropped += len(entries)
            log.error("decision log: %d entries dropped (store unavailable)", len(entries))


def log_entry(decision_id: str, revision: str, input_doc: dict[str, Any], result: dict[str, Any],
              mask: tuple[str, ...], request_id: str) -> dict[str, Any]:
    """One decision log entry, in OPA's shape where it fits."""
    shown, erased = erase(input_doc, mask)
    entry: dict[str, Any] = {
        "decision_id": decision_id, "revision": revision, "path": PATH, "input": shown, "result": result,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z",
        "request_id": request_id,
    }
    if erased:
        entry["erased"] = erased
    return entry
