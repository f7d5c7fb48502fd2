"""SLO gates per request class (issue 15, part 4): which measured configurations are eligible, and
the best of those by cost or throughput - never the best of all.

A gate holds when
- every hard constraint has evidence and it passed (unknown evidence fails, as routing does),
- the quality measured for the class meets its threshold (a measured input; unknown fails), and
- joint attainment Pr(TTFT <= F, TPOT <= D, E2E <= L | admitted) >= alpha.

Attainment is conditional on admission, so it is always published with the admission rate: a
configuration that refuses most requests can attain anything on the few it admits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Gate:
    request_class: str
    ttft_s: float  # F
    tpot_s: float  # D
    e2e_s: float  # L
    alpha: float  # the joint attainment required among admitted requests
    quality_min: float | None = None  # e.g. the evaluation's pass rate; None: no quality gate
    hard: tuple[str, ...] = ()  # constraints whose evidence must be present and passing


@dataclass(frozen=True)
class Sample:
    """One request as measured (a replay's record or a ledger entry)."""

    admitted: bool
    ttft_s: float | None = None  # a JSON answer's first byte is its whole answer: pass e2e
    tpot_s: float | None = None  # None: fewer than two output tokens, no time per token to hold
    e2e_s: float | None = None  # None for an admitted request: it never finished (counts as missed)


@dataclass(frozen=True)
class Verdict:
    gate: Gate
    requests: int
    admitted: int
    met: int  # admitted requests within all three bounds
    eligible: bool
    reasons: tuple[str, ...] = field(default=())

    @property
    def admission_rate(self) -> float:
        return self.admitted / self.requests if self.requests else 0.0

    @property
    def attainment(self) -> float:
        return self.met / self.admitted if self.admitted else 0.0

    def __str__(self) -> str:
        state = "eligible" if self.eligible else "not eligible: " + "; ".join(self.reasons)
        return (f"{self.gate.request_class}: attainment {self.attainment:.1%} of {self.admitted} admitted "
                f"(admission {self.admission_rate:.1%} of {self.requests}); {state}")


def within(s: Sample, g: Gate) -> bool:
    if s.e2e_s is None or s.e2e_s > g.e2e_s:
        return False
    if s.ttft_s is not None and s.ttft_s > g.ttft_s:
        return False
    return s.tpot_s is None or s.tpot_s <= g.tpot_s


def evaluate(gate: Gate, samples: Iterable[Sample], quality: float | None = None,
             evidence: Mapping[str, bool | None] | None = None) -> Verdict:
    rows = list(samples)
    admitted = [s for s in rows if s.admitted]
    met = sum(within(s, gate) for s in admitted)
    reasons = []
    for name in gate.hard:
        passed = (evidence or {}).get(name)
        if passed is None:
            reasons.append(f"no evidence for {name}")
        elif not passed:
            reasons.append(f"{name} failed")
    if gate.quality_min is not None:
        if quality is None:
            reasons.append("quality not measured")
        elif quality < gate.quality_min:
            reasons.append(f"quality {quality:g} below {gate.quality_min:g}")
    if not admitted:
        reasons.append("no request admitted")
    elif met / len(admitted) < gate.alpha:
        reasons.append(f"attainment {met / len(admitted):.1%} below {gate.alpha:.1%}")
    return Verdict(gate, len(rows), len(admitted), met, not reasons, tuple(reasons))


@dataclass(frozen=True)
class Candidate:
    """A measured configuration: its verdicts (one per gated class), its cost per accepted task, and
    the throughput it sustained."""

    name: str
    verdicts: Sequence[Verdict]
    cost_per_accepted_task: float
    throughput_rps: float

    @property
    def eligible(self) -> bool:
        return bool(self.verdicts) and all(v.eligible for v in self.verdicts)


def best(candidates: Iterable[Candidate], objective: str = "cost") -> Candidate | None:
    """The cheapest (or highest-throughput) among the eligible; None when none is."""
    eligible = [c for c in candidates if c.eligible]
    if not eligible:
        return None
    if objective == "cost":
        return min(eligible, key=lambda c: (c.cost_per_accepted_task, -c.throughput_rps))
    if objective == "throughput":
        return max(eligible, key=lambda c: (c.throughput_rps, -c.cost_per_accepted_task))
    raise ValueError(f"objective: cost or throughput, not {objective!r}")
