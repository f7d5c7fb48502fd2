"""`llmgw up`'s loops (llmgw/ops/gateway_loops.py) aimed at its own stack, the engine check it runs
once before it says it is up, and the lines it prints for candidates that do not serve."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from extproc.config import load_snapshot
from llmgw.local.procs import json_at, wait_until
from llmgw.local.stack import Stack
from llmgw.ops import gateway_loops
from llmgw.ops.gateway_loops import LoopTargets
from llmgw.ops.loops import Loops
from llmgw.ops.requalify import fix_command


def targets(stack: Stack, config: Path) -> LoopTargets:
    assert stack.store_url is not None
    return LoopTargets(config=config, store_url=stack.store_url,
                       engines={p: stack.engine_urls(p) for p in stack.render.pools},
                       status_urls=stack.status_urls, admin_token_file=stack.admin_token_file,
                       state_file=stack.loops_state, stand_in_engines=stack.opts.engine == "vllm",
                       intervals=stack.snapshot.gateway.loops)


def settle(stack: Stack, config: Path, timeout: float = 20.0) -> str:
    """Before `llmgw up` says it is up: the engine check once (a void an earlier run left - another
    engine served then - is lifted, or one written, before the first request rather than a loop
    interval later), and the workers serving the revision that leaves. What the check did, when it
    changed anything ("" otherwise)."""
    if stack.snapshot.gateway.loops.engine_verify_s <= 0 or not stack.render.pools:
        return ""
    said = gateway_loops.engine_verify(targets(stack, config))
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
    return gateway_loops.start(targets(stack, config))
