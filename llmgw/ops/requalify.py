"""What brings an unqualified candidate back: the one command for its case, as `llmgw check` and
`llmgw up` print it beside why the candidate is out.

- An engine that serves something other than its fingerprint declares (`engine_mismatch`): earning
  again would prove nothing of the fingerprint; the engine check lifts the void once the engines match.
- Otherwise the evidence its route requires, earned again (a void, a failed record, an expiry or a
  changed basis all end the same way): `llmgw conformance`, `llmgw evaluate`, `llmgw bench sweep
  --evidence`, each naming the route and the candidate. A candidate `llmgw up` simulates itself (a pool
  of simulated engines, a hosted deployment on loopback) is earned again by `llmgw demo-evidence` - or
  by the next `llmgw up`, which does the same before it serves.
"""

from __future__ import annotations

from datetime import date

from extproc.config import Snapshot
from extproc.config.evidence import ENGINE_MISMATCH
from extproc.config.schema import Route


def fix_command(snap: Snapshot, route: Route, deployment: str, today: date, config: str) -> str:
    """The command (with what to do first, where something must be done first) that re-qualifies
    `deployment` as a candidate of `route`; "" when it is qualified."""
    from llmgw.render.bootstrap import simulated_providers

    dep = snap.deployments[deployment]
    missing = snap.missing_evidence(route, dep.ref, today)
    if not missing:
        return ""
    if ENGINE_MISMATCH in snap.void_triggers.get(dep.ref, frozenset()):
        return (f"make its engines serve what deployments/{deployment}.yaml declares (or declare what they serve, "
                f"and earn that), then `llmgw engines verify --config {config}`")
    if dep.pool is not None or dep in simulated_providers(snap):
        return f"`llmgw demo-evidence --config {config}` (or restart `llmgw up`, which earns it before serving)"
    name = route.route_contract
    steps = {"conformance": f"`llmgw conformance --config {config} --route {name} --deployment {deployment}`",
             "quality_gate": f"`llmgw evaluate --config {config} --route {name} --candidate {deployment}`",
             "load": f"`llmgw bench sweep TRACE --config {config} --evidence` (through the running gateway)"}
    return ", then ".join(steps[k] for k in sorted(missing) if k in steps)
