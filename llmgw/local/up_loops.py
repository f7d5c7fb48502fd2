"""The supervised loops `llmgw up` runs beside its processes (llmgw/ops/loops.py), so that a drift
trigger fires without an operator: each at its interval in gateway.yaml `loops` (0: off).

- engine_verify: every pool engine against its deployment's fingerprint (llmgw/ops/engines.py); a
  mismatch writes a void, a match again removes it. Hosted deployments: the model their recent answers
  named (the ledger), a `model_mismatch` void when it is not the declared one.
- reevaluate: provider drift, SLO regression and workload shift from the ledger
  (llmgw/ops/reevaluate.py: its default bounds, each request class's objective), each finding a void record.
- canary_watch: each route's canary against its stable candidates; a regression rolls it back as an
  audited revision (llmgw/ops/canary.py).

Voids land in the earned state (extproc/config/earned.py), which the workers watch: the candidate
leaves routing at their next reload (within a second). The loops read the policy as it is at each run.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from extproc.config import load_snapshot
from llmgw.local.procs import json_at, wait_until
from llmgw.local.stack import Stack
from llmgw.ops import canary, engines, reevaluate
from llmgw.ops.loops import Loops
from llmgw.ops.requalify import fix_command
from llmgw.ops.store import store_client

WINDOW_S, BASELINE_S = 24 * 3600, 7 * 24 * 3600  # reevaluate's, as `llmgw evidence reevaluate` defaults
ANSWERS_S = 300.0  # how far back engine_verify reads hosted answers (each run overlaps the last: voids are daily)


def engine_verify(stack: Stack, config: Path, since: float | None = None) -> str:
    """The pools' engines probed; the hosted deployments' answers since `since` (default: the last
    ANSWERS_S seconds) read from the ledger."""
    snap = load_snapshot(config)
    # `--engine vllm` runs real vLLM's CPU build on a generated tiny model as a stand-in for the GPU
    # deployment the fingerprint declares (as the simulator stands in for it, reporting the declared
    # engine): its window, version and block size are the stand-in's by construction, so its pools are
    # not held to the fingerprint (a void written here could not be lifted by any engine up can run).
    stand_in = stack.opts.engine == "vllm"
    pools = set() if stand_in else {d.pool for d in snap.deployments.values() if d.pool}
    check = engines.verify(snap, {p: stack.engine_urls(p) for p in sorted(pools)})
    now = datetime.now(UTC)
    written, removed = engines.apply(snap, check, now)
    client = store_client(str(stack.store_url))
    try:
        answered = engines.answers_since(snap, client, since if since is not None else time.time() - ANSWERS_S)
    finally:
        client.close()
    written += engines.model_voids(snap, answered, now)
    parts = [f"{len(check.matching)} deployment(s) serve what they declare"]
    parts += ["the pools' engines are real vLLM stand-ins (the tiny model on CPU), not held to the fingerprint"
              ] if stand_in else []
    parts += [str(f) for f in (*check.findings, *answered)]
    parts += [f"unreachable: {', '.join(check.unreachable)}"] if check.unreachable else []
    parts += [f"void written: {p.name}" for p in written] + [f"void removed: {p.name}" for p in removed]
    return "; ".join(parts)


def reevaluate_once(stack: Stack, config: Path) -> str:
    snap = load_snapshot(config)
    client = store_client(str(stack.store_url))
    try:
        window, before = reevaluate.windows(client, sorted(snap.gateway.tenants), time.time(), WINDOW_S, BASELINE_S)
    finally:
        client.close()
    window = reevaluate.after_earning(window, snap)
    findings = reevaluate.evaluate(window, before, reevaluate.Bounds(objectives=reevaluate.objectives_of(snap.gateway)))
    paths = reevaluate.void_files(findings, dict(snap.deployments), config, datetime.now(UTC))
    return "; ".join([f"{len(window)} ledger entries", *(f"{f.deployment}: {f.trigger}: {f.reason}" for f in findings),
                      *(f"void written: {p.name}" for p in paths)])


def canary_watch(stack: Stack, config: Path) -> str:
    client = store_client(str(stack.store_url))
    said: list[str] = []
    try:
        # What it saw per route goes to the loop's state. (Not by redirecting stdout: that is the
        # process's, and `llmgw up`'s own lines printed meanwhile - its banner, with the demo keys -
        # went into this loop's state instead of the terminal.)
        rolled = canary.watch_once(client, config, stack.status_urls,
                                   token=stack.admin_token_file.read_text().strip(), say=said.append)
    finally:
        client.close()
    return "; ".join(said + [f"rolled back: {r}" for r in rolled]) or "no canary"


def settle(stack: Stack, config: Path, timeout: float = 20.0) -> str:
    """Before `llmgw up` says it is up: the engine check once (a void an earlier run left - another
    engine served then - is lifted, or one written, before the first request rather than a loop
    interval later), and the workers serving the revision that leaves. What the check did, when it
    changed anything ("" otherwise)."""
    if stack.snapshot.gateway.loops.engine_verify_s <= 0 or not stack.render.pools:
        return ""
    said = engine_verify(stack, config)
    current = load_snapshot(config, earned=stack.evidence_dir)
    if current.revision == stack.snapshot.revision:
        return ""
    wait_until(lambda: all(json_at(u).get("revision") == current.revision for u in stack.status_urls),
               timeout, f"the workers reloading after the engine check ({said})")
    stack.snapshot = current
    return said


def unqualified(config: Path, shown: str) -> list[str]:
    """A line per route candidate that does not serve for want of evidence: why, and the command that
    brings it back (llmgw/ops/requalify.py)."""
    snap = load_snapshot(config)
    today = datetime.now(UTC).date()
    out = []
    for name, route in sorted(snap.routes.items()):
        for cand in route.candidates:
            if why := snap.why_unqualified(route, cand.deployment_ref, today):
                out.append(f"not serving: route {name} candidate {cand.deployment_name}: {why}; to qualify it: "
                           f"{fix_command(snap, route, cand.deployment_name, today, shown)}")
    return out


def start(stack: Stack, config: Path) -> Loops:
    """The loops for this stack, at gateway.yaml's intervals, started."""
    settings = stack.snapshot.gateway.loops
    loops = Loops(stack.loops_state)
    for name, interval, run in (("engine_verify", settings.engine_verify_s, engine_verify),
                                ("reevaluate", settings.reevaluate_s, reevaluate_once),
                                ("canary_watch", settings.canary_watch_s, canary_watch)):
        if interval > 0:
            loops.add(name, interval, lambda run=run: run(stack, config))  # type: ignore[misc]
    return loops.start()
