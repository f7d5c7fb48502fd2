"""What a sweep level gave each tenant in each request class (issue 33): offered and admitted rates, the
share refused as `overloaded`, and how fair the admitted rates were.

Admission serves the higher priority first and shares within a priority by tenant weight, so fairness
is judged per request class: against the max-min fair allocation of what the class was admitted
(water-filling by tenant weight), a tenant offering less than its weighted share is owed all it
offered, and the rest is split among the others by weight. Jain's index over each tenant's admitted
rate divided by what it was owed is 1 when admission matched that allocation, and falls towards 1/n as
one tenant takes the others' share. (Jain's index over raw admitted rates would call it unfair to serve
a light tenant everything it asked while a heavy one is cut back: that is the fair outcome.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw.bench.openloop import Outcome
from llmgw.bench.slo import Gate, Sample, within
from llmgw.bench.workload import TraceRecord


@dataclass(frozen=True)
class TenantLevel:
    request_class: str
    tenant: str
    offered_rps: float
    admitted_rps: float
    overloaded: float  # share of its requests refused as `overloaded`
    owed_rps: float  # its max-min fair share of the class's admitted rate
    good_rps: float  # admitted and within its class's objective (every limit at once)
    good_owed_rps: float  # its max-min fair share of the class's good rate


def jain(values: Sequence[float]) -> float:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all are equal."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def max_min_fair(offered: Mapping[str, float], capacity: float, weights: Mapping[str, float]) -> dict[str, float]:
    """Water-filling: each tenant gets min(its offer, its weighted share of what is left), in rounds."""
    owed = dict.fromkeys(offered, 0.0)
    left, active = capacity, {t for t, x in offered.items() if x > 0}
    while active and left > 1e-12:
        total_w = sum(weights.get(t, 1.0) for t in active)
        share = {t: left * weights.get(t, 1.0) / total_w for t in active}
        capped = {t for t in active if offered[t] - owed[t] <= share[t]}
        if not capped:
            for t in active:
                owed[t] += share[t]
            break
        for t in capped:
            left -= offered[t] - owed[t]
            owed[t] = offered[t]
        active -= capped
    return owed


# Per request class: its tenants, Jain's index of admitted over owed, and of within-objective over owed.
ClassFairness = tuple[str, tuple[TenantLevel, ...], float, float]
TenantLevels = tuple[ClassFairness, ...]


def tenant_levels(outcomes: Sequence[Outcome], trace: Sequence[TraceRecord], speed: float,
                  weights: Mapping[str, float], gates: Mapping[str, Gate]) -> TenantLevels:
    """Each request class's tenants at one level, with Jain's index of admitted over owed and of
    within-objective over owed: when everything is admitted (no admission control) the first is 1 by
    construction, and what the engines' slowdown took from each tenant shows in the second."""
    span = max((trace[-1].at - trace[0].at) / speed if len(trace) > 1 else 1.0, 1e-9)

    def good(o: Outcome) -> bool:
        gate = gates.get(o.record.request_class)
        return o.admitted and gate is not None and within(
            Sample(True, o.ttft_s if o.record.stream else None, o.tpot_s, o.e2e_s), gate)

    out = []
    for cls in sorted({r.request_class for r in trace}):
        mine = [o for o in outcomes if o.record.request_class == cls]
        tenants = sorted({r.tenant for r in trace if r.request_class == cls})
        offered = {t: sum(r.tenant == t and r.request_class == cls for r in trace) / span for t in tenants}
        admitted = {t: sum(o.admitted for o in mine if o.record.tenant == t) / span for t in tenants}
        good_rps = {t: sum(good(o) for o in mine if o.record.tenant == t) / span for t in tenants}
        owed = max_min_fair(offered, sum(admitted.values()), weights)
        good_owed = max_min_fair(offered, sum(good_rps.values()), weights)
        rows = tuple(TenantLevel(cls, t, offered[t], admitted[t],
                                 sum(o.code == "overloaded" for o in mine if o.record.tenant == t)
                                 / max(1, sum(o.record.tenant == t for o in mine)), owed[t],
                                 good_rps[t], good_owed[t]) for t in tenants)
        out.append((cls, rows, jain([admitted[t] / owed[t] for t in tenants if owed[t] > 0]),
                    jain([good_rps[t] / good_owed[t] for t in tenants if good_owed[t] > 0])))
    return tuple(out)


def tenant_table(speeds: Sequence[float], per_level: Sequence[TenantLevels]) -> str:
    head = ["speed", "class", "tenant", "offered req/s", "admitted req/s", "refused overloaded",
            "owed (max-min) req/s", "Jain (admitted/owed)", "within objective req/s", "owed of those",
            "Jain (within/owed)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for speed, classes in zip(speeds, per_level, strict=True):
        for _, tenants, index, good_index in classes:
            rows += [f"| {speed:g} | {t.request_class} | {t.tenant} | {t.offered_rps:.2f} | {t.admitted_rps:.2f} | "
                     f"{t.overloaded:.1%} | {t.owed_rps:.2f} | {index:.3f} | {t.good_rps:.2f} | "
                     f"{t.good_owed_rps:.2f} | {good_index:.3f} |" for t in tenants]
    return "\n".join(rows) + "\n"
