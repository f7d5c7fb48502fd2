"""The load gate: a sweep's levels judged against the policy's request classes, jointly, and the `load`
evidence it earns (`llmgw bench sweep --config DIR --evidence`).

Each class in the trace is gated on its own objective (gateway.yaml `request_classes.<c>.slo`: TTFT,
TPOT and end-to-end limits held jointly by `attainment` of its admitted requests); a level holds when
every class does. The record is judged at each class's declared peak rate (`slo.peak_rps`): the first
level that offered the class at least that rate must hold for it. A class never offered its peak fails
(the sweep did not reach it). The record names the service rate (mu), the knee, each class's figures
there, and the digest of the objectives it was judged on: a changed limit or peak voids it
(extproc/config/evidence.py). It is written for each candidate that answered at those levels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import date, timedelta
from typing import Any

from extproc.config import Snapshot
from extproc.config.evidence import objectives_digest
from llmgw.bench.openloop import Outcome
from llmgw.bench.slo import Gate, Sample, evaluate
from llmgw.bench.stats import percentile
from llmgw.bench.workload import TraceRecord

SOURCE = "llmgw bench sweep"


@dataclass(frozen=True)
class ClassLevel:
    request_class: str
    offered_rps: float
    attainment: float
    admission: float
    holds: bool
    ttft_p99_s: float | None = None  # of its admitted streams
    tpot_p99_s: float | None = None
    overloaded: float = 0.0  # the share of its requests refused as `overloaded` (admission control)


def class_gates(snap: Snapshot, classes: Sequence[str]) -> dict[str, Gate]:
    """Each class's gate from its objective (a limit it does not set holds at any value)."""
    gates = {}
    for name in classes:
        rc = snap.gateway.request_classes.get(name)
        if rc is None or rc.slo is None:
            raise ValueError(f"request class {name!r} declares no objective (gateway.yaml request_classes.{name}.slo)")
        slo = rc.slo

        def limit(ms: int | None) -> float:
            return ms / 1000 if ms is not None else math.inf

        gates[name] = Gate(name, limit(slo.ttft_ms), limit(slo.tpot_ms), limit(slo.e2e_ms), slo.attainment)
    return gates


def measure_classes(outcomes: Sequence[Outcome], trace: Sequence[TraceRecord], speed: float,
                    gates: Mapping[str, Gate], min_admission: float) -> tuple[ClassLevel, ...]:
    """Each gated class at one level: its offered rate, joint attainment among its admitted, admission."""
    span = (trace[-1].at - trace[0].at) / speed if len(trace) > 1 else 1.0
    out = []
    for name, gate in gates.items():
        mine = [o for o in outcomes if o.record.request_class == name]
        offered = sum(r.request_class == name for r in trace) / max(span, 1e-9)
        v = evaluate(gate, [Sample(o.admitted, o.ttft_s if o.record.stream else None, o.tpot_s, o.e2e_s)
                            for o in mine])
        ttft = [o.ttft_s for o in mine if o.e2e_s is not None and o.ttft_s is not None and o.record.stream]
        tpot = [o.tpot_s for o in mine if o.e2e_s is not None and o.tpot_s is not None]
        out.append(ClassLevel(name, offered, v.attainment, v.admission_rate,
                              v.eligible and v.admission_rate >= min_admission,
                              percentile(ttft, 99) if ttft else None, percentile(tpot, 99) if tpot else None,
                              sum(o.code == "overloaded" for o in mine) / max(1, len(mine))))
    return tuple(out)


def at_peaks(levels: Sequence[tuple[ClassLevel, ...]], peaks: Mapping[str, float]) -> dict[str, tuple[int, ClassLevel]]:
    """For each class, the first level (by its offered rate) that offered it at least its peak: (that
    level's index, the class there); a class never offered its peak: its busiest level, which fails."""
    out = {}
    for name, peak in peaks.items():
        seen = sorted(((i, c) for i, lv in enumerate(levels) for c in lv if c.request_class == name),
                      key=lambda ic: ic[1].offered_rps)
        if not seen:
            continue
        reached = [(i, c) for i, c in seen if c.offered_rps >= peak]
        i, c = reached[0] if reached else seen[-1]
        out[name] = (i, c if reached else replace(c, holds=False))
    return out


def record(snap: Snapshot, peaks: Mapping[str, float], judged: Mapping[str, tuple[int, ClassLevel]], mu: float,
           knee_rps: float | None, trace_name: str, today: date, valid_days: int) -> dict[str, Any]:
    """The load record (extproc/config/schema.Evidence), without its basis."""
    classes = {name: {"peak_rps": peaks[name], "offered_rps": round(c.offered_rps, 3),
                      "attainment": round(c.attainment, 4), "admission": round(c.admission, 4), "holds": c.holds}
               for name, (_, c) in sorted(judged.items())}
    passed = bool(classes) and all(c["holds"] for c in classes.values()) and set(judged) == set(peaks)
    return {"deployment_ref": "", "kind": "load", "result": "pass" if passed else "fail",
            "recorded_at": today.isoformat(), "expires_at": (today + timedelta(days=valid_days)).isoformat(),
            "source": SOURCE, "corpus_version": trace_name,
            "load": {"mu_rps": round(mu, 3), "knee_rps": None if knee_rps is None else round(knee_rps, 3),
                     "classes": classes, "objectives_digest": objectives_digest(snap.gateway, peaks)}}
