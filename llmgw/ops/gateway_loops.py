"""The supervised loops of a running gateway, so that a drift trigger fires without an operator: each
at its interval in gateway.yaml `loops` (0: off). `llmgw up` runs them beside its processes;
`llmgw loops` runs them as a service of their own (docker-compose's `loops`).

- engine_verify: every pool engine against its deployment's fingerprint (llmgw/ops/engines.py); a
  mismatch writes a void, a match again removes it. Hosted deployments: the model their recent answers
  named (the ledger), a `model_mismatch` void when it is not the declared one.
- reevaluate: provider drift, SLO regression and workload shift from the ledger
  (llmgw/ops/reevaluate.py: its default bounds, each request class's objective), each finding a void record.
- canary_watch: each route's canary against its stable candidates; a regression rolls it back as an
  audited revision (llmgw/ops/canary.py).

Voids land in the earned state (extproc/config/earned.py, `$LLMGW_EVIDENCE_DIR`), which the workers
watch: the candidate leaves routing at their next reload (within a second). The loops read the policy
as it is at each run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from extproc.config import load_snapshot
from extproc.config.schema import LoopSettings
from llmgw.ops import canary, engines, reevaluate
from llmgw.ops.loops import Loops
from llmgw.ops.store import store_client

WINDOW_S, BASELINE_S = 24 * 3600, 7 * 24 * 3600  # reevaluate's, as `llmgw evidence reevaluate` defaults
ANSWERS_S = 300.0  # how far back engine_verify reads hosted answers (each run overlaps the last: voids are daily)


@dataclass(frozen=True)
class LoopTargets:
    """What the loops act on: one gateway's policy, store, engines and workers."""

    config: Path  # the live policy directory
    store_url: str
    engines: Mapping[str, Sequence[str]]  # pool -> its engines' URLs (http://host:port)
    status_urls: Sequence[str]  # each worker's status server (canary rollbacks reload them)
    admin_token_file: Path | None  # the workers' POST /reload token
    state_file: Path  # where the loops' state is written (the workers' GET /status shows it)
    # The pools' engines stand in for the declared deployment (real vLLM on CPU in `llmgw up --engine vllm`):
    # not held to the fingerprint, since no engine that can run here could lift a void written then.
    stand_in_engines: bool = False
    intervals: LoopSettings = field(default_factory=LoopSettings)


def engine_verify(t: LoopTargets, since: float | None = None) -> str:
    """The pools' engines probed; the hosted deployments' answers since `since` (default: the last
    ANSWERS_S seconds) read from the ledger."""
    snap = load_snapshot(t.config)
    pools = set() if t.stand_in_engines else {d.pool for d in snap.deployments.values() if d.pool}
    check = engines.verify(snap, {p: list(t.engines.get(p, ())) for p in sorted(pools)})
    now = datetime.now(UTC)
    written, removed = engines.apply(snap, check, now)
    client = store_client(t.store_url)
    try:
        answered = engines.answers_since(snap, client, since if since is not None else time.time() - ANSWERS_S)
    finally:
        client.close()
    written += engines.model_voids(snap, answered, now)
    parts = [f"{len(check.matching)} deployment(s) serve what they declare"]
    parts += ["the pools' engines are real vLLM stand-ins (the tiny model on CPU), not held to the fingerprint"
              ] if t.stand_in_engines else []
    parts += [str(f) for f in (*check.findings, *answered)]
    parts += [f"unreachable: {', '.join(check.unreachable)}"] if check.unreachable else []
    parts += [f"void written: {p.name}" for p in written] + [f"void removed: {p.name}" for p in removed]
    return "; ".join(parts)


def reevaluate_once(t: LoopTargets) -> str:
    snap = load_snapshot(t.config)
    client = store_client(t.store_url)
    try:
        window, before = reevaluate.windows(client, sorted(snap.gateway.tenants), time.time(), WINDOW_S, BASELINE_S)
    finally:
        client.close()
    window = reevaluate.after_earning(window, snap)
    findings = reevaluate.evaluate(window, before, reevaluate.Bounds(objectives=reevaluate.objectives_of(snap.gateway)))
    paths = reevaluate.void_files(findings, dict(snap.deployments), t.config, datetime.now(UTC))
    return "; ".join([f"{len(window)} ledger entries", *(f"{f.deployment}: {f.trigger}: {f.reason}" for f in findings),
                      *(f"void written: {p.name}" for p in paths)])


def canary_watch(t: LoopTargets) -> str:
    client = store_client(t.store_url)
    said: list[str] = []
    try:
        # What it saw per route goes to the loop's state. (Not by redirecting stdout: that is the
        # process's, and `llmgw up`'s own lines printed meanwhile - its banner, with the demo keys -
        # went into this loop's state instead of the terminal.)
        token = t.admin_token_file.read_text().strip() if t.admin_token_file else ""
        rolled = canary.watch_once(client, t.config, list(t.status_urls), token=token, say=said.append)
    finally:
        client.close()
    return "; ".join(said + [f"rolled back: {r}" for r in rolled]) or "no canary"


def start(t: LoopTargets) -> Loops:
    """The loops at their intervals, started (each on its own thread)."""
    loops = Loops(t.state_file)
    for name, interval, run in (("engine_verify", t.intervals.engine_verify_s, engine_verify),
                                ("reevaluate", t.intervals.reevaluate_s, reevaluate_once),
                                ("canary_watch", t.intervals.canary_watch_s, canary_watch)):
        if interval > 0:
            loops.add(name, interval, lambda run=run: run(t))  # type: ignore[misc]
    return loops.start()
