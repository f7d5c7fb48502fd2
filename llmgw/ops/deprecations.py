"""Deprecations as scheduled outages: a deployment's `retire_at` with its owner and a tested
replacement. `llmgw check` fails when, inside the warning window, the owner or the replacement is
missing or the replacement cannot take the traffic; before the window the same findings are
warnings. After the date the deployment is out of routing (extproc/stages/route.py).

A replacement is either a route (callers move to it: it needs a qualified candidate other than the
retiring deployment, covering the data classes the retiring one served) or a deployment (it takes
the retiring one's place: it must be a qualified candidate of every route the retiring one serves).
Qualified here means what routing checks ahead of any request: the reference matches, not withdrawn,
not retiring by the same date, and passing evidence of every required kind for that exact fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from extproc.config import Snapshot
from extproc.config.schema import RETIRE_WARNING_DAYS, Candidate, Deployment, Route


@dataclass(frozen=True)
class Finding:
    deployment: str
    error: bool  # inside the warning window: `llmgw check` fails
    text: str


def _qualified(snap: Snapshot, route: Route, cand: Candidate, by: date, today: date) -> bool:
    dep = snap.deployments.get(cand.deployment_name)
    return (dep is not None and dep.ref == cand.deployment_ref and not dep.withdrawn
            and (dep.retire_at is None or dep.retire_at > by)
            and not snap.missing_evidence(route, cand.deployment_ref, today))


def replacement_problems(snap: Snapshot, dep: Deployment, today: date) -> list[str]:
    """Why this retiring deployment's replacement cannot take its traffic (empty: it can)."""
    assert dep.retire_at is not None
    problems = [] if dep.retire_owner else ["no retire_owner: nobody owns the move"]
    name = dep.retire_replacement
    if name is None:
        return [*problems, "no retire_replacement"]
    if name in snap.routes:
        route = snap.routes[name]
        usable = [c for c in route.candidates
                  if c.deployment_name != dep.deployment and _qualified(snap, route, c, dep.retire_at, today)]
        served = {dc for c in usable for dc in c.data_classes}
        if not usable:
            problems.append(f"replacement route {name} has no qualified candidate besides {dep.deployment}")
        elif missing := sorted(set(dep.data_classes) - served):
            problems.append(f"replacement route {name} serves none of {', '.join(missing)}")
    elif name in snap.deployments:
        for route_name, route in sorted(snap.routes.items()):
            if not any(c.deployment_name == dep.deployment for c in route.candidates):
                continue
            cand = next((c for c in route.candidates if c.deployment_name == name), None)
            if cand is None:
                problems.append(f"replacement {name} is not a candidate of route {route_name}")
            elif not _qualified(snap, route, cand, dep.retire_at, today):
                problems.append(f"replacement {name} is not qualified on route {route_name} (evidence, "
                                "withdrawal or its own retirement)")
    else:
        problems.append(f"retire_replacement {name!r} names no route or deployment")
    return problems


def findings(snap: Snapshot, today: date, window_days: int = RETIRE_WARNING_DAYS) -> list[Finding]:
    out = []
    for dep in sorted(snap.deployments.values(), key=lambda d: d.deployment):
        if dep.retire_at is None or dep.retire_at <= today:
            continue  # retired ones are out of routing already (a load warning says so)
        days = (dep.retire_at - today).days
        for problem in replacement_problems(snap, dep, today):
            out.append(Finding(dep.deployment, days <= window_days,
                               f"deployment {dep.deployment} retires {dep.retire_at} (in {days} days): {problem}"))
    return out
