"""The sweep's arithmetic (llmgw/bench/sweep.py) on hand-made outcomes: offered and completed rates, the
gate per level, and the knee - the highest load below the first level where the gate fails."""

from __future__ import annotations

import pytest

from llmgw.bench.fairness import jain, max_min_fair, tenant_levels, tenant_table
from llmgw.bench.openloop import Outcome
from llmgw.bench.slo import Gate
from llmgw.bench.sweep import Level, knee, measure
from llmgw.bench.workload import TraceRecord

GATE = Gate("chat", ttft_s=0.5, tpot_s=0.05, e2e_s=2.0, alpha=0.9)


def rec(at: float) -> TraceRecord:
    return TraceRecord(at=at, request_class="chat", route="chat-default", tenant="acme", data_class="internal",
                       input_tokens=10, output_tokens=10, stream=True)


def out(r: TraceRecord, e2e: float | None, status: int = 200, code: str = "") -> Outcome:
    return Outcome(r, 0.001, status, code, "rid", 0.1 if e2e else None, 0.01 if e2e else None, e2e, 10, 1, False)


def test_a_level_s_rates_attainment_and_gate() -> None:
    trace = [rec(i * 0.5) for i in range(10)]  # 10 requests over 4.5 s: 2.2 req/s at speed 1
    outcomes = [out(r, 1.1) for r in trace[:8]] + [out(trace[8], 3.0), out(trace[9], None, 429, "rate_limited")]
    lv = measure(outcomes, trace, speed=2.0, wall_s=4.0, gate=GATE, min_admission=0.95)
    assert round(lv.offered_rps, 2) == round(10 / 2.25, 2)  # twice the trace's rate
    # Sends at 0.001 + i/4 s; answers 1.1 s later (the 9th 3 s later): 9 answers over the busy
    # period from the first send (0.001 s) to the last answer (5.001 s).
    assert abs(lv.completed_rps - 9 / 5.0) < 1e-9
    assert lv.admission == 0.9 and lv.attainment == 8 / 9
    assert not lv.holds  # 88.9% < alpha 90%, and admission 90% < 95%


def level(rps: float, holds: bool, completed: float) -> Level:
    return Level(1.0, rps, completed, 1.0, 1.0 if holds else 0.5, holds, None, None, None, None, None, None, 0.0)


def test_the_knee_is_the_last_holding_level_before_the_first_miss() -> None:
    levels = [level(8, False, 20), level(1, True, 1), level(2, True, 2), level(4, False, 3.5), level(16, True, 20)]
    assert knee(levels) == levels[2]  # 2 req/s; the 16 req/s "hold" past a miss is not capacity
    assert knee([level(1, False, 1)]) is None


def test_every_class_is_gated_jointly_and_judged_at_its_peak() -> None:
    """Two classes in one trace: each on its own gate; the class offered its peak first at the level it
    is judged at; one never offered its peak fails the record."""
    from llmgw.bench.load_gate import ClassLevel, at_peaks, measure_classes

    batch = GATE.__class__("batch", ttft_s=10.0, tpot_s=1.0, e2e_s=60.0, alpha=0.9)
    trace = [rec(i * 0.5) for i in range(6)] + [TraceRecord(at=3.0 + i, request_class="batch", route="chat-default",
                                                            tenant="acme", data_class="internal", input_tokens=10,
                                                            output_tokens=10) for i in range(2)]
    outcomes = [out(r, 1.1) for r in trace[:6]] + [out(r, 30.0) for r in trace[6:]]
    chat, slow = measure_classes(outcomes, trace, 1.0, {"chat": GATE, "batch": batch}, min_admission=0.95)
    assert (chat.request_class, chat.holds, slow.holds) == ("chat", True, True)
    assert abs(chat.offered_rps - 6 / 4.0) < 1e-9  # 6 of the 8 requests over the trace's 4 s
    late = [out(r, 1.1) for r in trace[:5]] + [out(trace[5], 5.0)] + [out(r, 30.0) for r in trace[6:]]
    chat_late, _ = measure_classes(late, trace, 1.0, {"chat": GATE, "batch": batch}, min_admission=0.95)
    assert not chat_late.holds and chat_late.attainment == 5 / 6  # below alpha 0.9: the level misses

    levels = [(ClassLevel("chat", 1.0, 1.0, 1.0, True),), (ClassLevel("chat", 2.0, 0.5, 1.0, False),),
              (ClassLevel("chat", 4.0, 0.2, 1.0, False),)]
    assert at_peaks(levels, {"chat": 1.5}) == {"chat": (1, levels[1][0])}  # the first level at or above 1.5
    assert at_peaks(levels, {"chat": 1.0}) == {"chat": (0, levels[0][0])}
    (i, never), = at_peaks(levels, {"chat": 8.0}).values()
    assert (i, never.offered_rps, never.holds) == (2, 4.0, False)  # the busiest level, failing


def test_max_min_fair_shares_and_jain_s_index() -> None:
    # A light tenant is owed all it offers; the heavy one the rest.
    assert max_min_fair({"a": 10.0, "b": 2.0}, 6.0, {}) == {"a": 4.0, "b": 2.0}
    # Both above their share: split by weight.
    assert max_min_fair({"a": 10.0, "b": 10.0}, 6.0, {"a": 2.0}) == {"a": 4.0, "b": 2.0}
    # Everything offered fits: everyone owed its offer.
    assert max_min_fair({"a": 1.0, "b": 2.0}, 3.0, {}) == {"a": 1.0, "b": 2.0}
    assert jain([1.0, 1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    # First come, first served with five times the load: admitted 5:1 against owed 1:1.
    assert round(jain([5 / 3, 1 / 3]), 3) == 0.692


def test_fairness_is_judged_per_class_against_the_max_min_share() -> None:
    def rec(i: int, tenant: str, cls: str) -> TraceRecord:
        return TraceRecord(at=float(i), request_class=cls, route="r", tenant=tenant, data_class="internal",
                           input_tokens=10, output_tokens=10)

    # One class: a offers 9 (5 admitted, one of them too slow), b offers 3 (all admitted); 10 s long.
    trace = [rec(i, "a" if i % 4 else "b", "chat") for i in range(12)]
    served = {"a": 0}

    def outcome(r: TraceRecord) -> Outcome:
        if r.tenant == "a":
            served["a"] += 1
            if served["a"] > 5:
                return Outcome(r, 0.0, 429, "overloaded", "", None, None, None, 0, 0, False)
            slow = served["a"] == 5
            return Outcome(r, 0.0, 200, "", "", 0.1, 0.01, 9.0 if slow else 1.0, 10, 1, False)
        return Outcome(r, 0.0, 200, "", "", 0.1, 0.01, 1.0, 10, 1, False)

    outcomes = [outcome(r) for r in trace]
    ((cls, rows, index, good_index),) = tenant_levels(outcomes, trace, 1.0, {}, {"chat": Gate("chat", 1, 1, 5, 0.9)})
    a, b = rows
    assert cls == "chat" and (a.tenant, b.tenant) == ("a", "b")
    assert round(a.offered_rps * 11, 6) == 9 and round(a.admitted_rps * 11, 6) == 5 and a.overloaded == 4 / 9
    # 8 admitted in all: b is owed its 3, a the other 5 - admitted as owed.
    assert round(b.owed_rps * 11, 6) == 3 and round(a.owed_rps * 11, 6) == 5 and index == pytest.approx(1.0)
    # 7 within the objective: b owed 3 and got 3, a owed 4 and got 4.
    assert round(a.good_rps * 11, 6) == 4 and good_index == pytest.approx(1.0)
    assert "| 1 | chat | a |" in tenant_table([1.0], [((cls, rows, index, good_index),)])
