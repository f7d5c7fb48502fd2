"""Which candidate of a route to prefer: the cheapest per accepted task among the eligible, never the
cheapest of all (llmgw/bench/slo.py `best`). `llmgw review` lists every route's candidates so, and
`llmgw plan` prices the hosted side with the one it picks.

- Eligible: every kind of evidence the route requires passes for the candidate (conformance, the
  class's quality gate, a load record where required) and, where a load record judged the route's
  class, the class held its objective at its peak rate. Unknown evidence is not eligible.
- Cost per request: the candidate's own prices (deployments/*.yaml, micro-units per million tokens)
  for a request of `input_tokens` in and `output_tokens` out.
- Accepted: a task answered right, so cost per accepted task = cost per request / the quality gate's
  score (the share of the class's tasks it answered right). A class without a quality gate grades
  nothing: its score is taken as 1 and said so.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from extproc.config import Snapshot
from extproc.config.schema import Route
from llmgw.bench.slo import Candidate, Gate, Verdict, best


@dataclass(frozen=True)
class Priced:
    deployment: str
    eligible: bool
    why_not: str  # "" when eligible
    quality: float | None  # the quality gate's score; None: the class grades nothing
    cost_per_request: float  # in the candidate's currency
    cost_per_accepted_task: float
    currency: str


def price(snap: Snapshot, route: Route, today: date, input_tokens: float, output_tokens: float) -> list[Priced]:
    """Every candidate of `route`, priced per accepted task, in the route's order."""
    out = []
    for cand in route.candidates:
        dep = snap.deployments.get(cand.deployment_name)
        if dep is None:
            continue
        records = snap.records_for(dep.ref, route)
        why = snap.why_unqualified(route, dep.ref, today)
        gates = [e for e in records if e.kind == "quality_gate" and e.result == "pass"]
        graded = snap.gateway.request_classes[route.request_class].quality is not None
        score = max((e.score or 0.0) for e in gates) if gates else (0.0 if graded else None)
        loads = [e.load.classes[route.request_class] for e in records if e.kind == "load" and e.load is not None]
        if not why and loads and not loads[-1].holds:
            why = f"{route.request_class} missed its objective at its peak rate"
        per_request = (input_tokens * dep.prices.input_per_mtok + output_tokens * dep.prices.output_per_mtok) / 1e12
        accepted = per_request / score if score else (per_request if score is None else float("inf"))
        out.append(Priced(dep.deployment, not why, why, score, per_request, accepted, dep.prices.currency))
    return out


def cheapest(priced: list[Priced], request_class: str) -> Priced | None:
    """The eligible candidate with the lowest cost per accepted task (slo.best), or None."""
    gate = Gate(request_class, 0.0, 0.0, 0.0, 0.0)
    by_name = {p.deployment: p for p in priced}
    chosen = best(Candidate(p.deployment, [Verdict(gate, 0, 0, 0, p.eligible, (p.why_not,) if p.why_not else ())],
                            p.cost_per_accepted_task, 0.0) for p in priced)
    return by_name[chosen.name] if chosen is not None else None


def lines(snap: Snapshot, today: date, input_tokens: float, output_tokens: float) -> list[str]:
    """`llmgw review`'s section: each route's candidates by cost per accepted task, the chosen one."""
    out = ["", f"## Candidates by cost per accepted task (a request of {input_tokens:g} tokens in, "
               f"{output_tokens:g} out)", ""]
    for name, route in sorted(snap.routes.items()):
        if route.serves != "chat":
            continue
        priced = price(snap, route, today, input_tokens, output_tokens)
        parts = []
        for p in priced:
            quality = "not graded" if p.quality is None else f"quality {p.quality:.2f}"
            state = "eligible" if p.eligible else f"NOT eligible ({p.why_not})"
            parts.append(f"{p.deployment}: {state}, {quality}, {p.cost_per_request:.6f} {p.currency} per request, "
                         f"{p.cost_per_accepted_task:.6f} per accepted task")
        chosen = cheapest(priced, route.request_class)
        out.append(f"- {name} ({route.request_class}): chosen {chosen.deployment if chosen else 'NONE eligible'}")
        out += [f"  - {part}" for part in parts]
    return out
