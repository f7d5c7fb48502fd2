"""SLO-gate arithmetic (issue 15, part 4) on hand-made samples: joint attainment among admitted
requests, published with the admission rate; unknown evidence and unmeasured quality fail; the best
configuration is chosen only among the eligible."""

from __future__ import annotations

import pytest

from llmgw.bench.slo import Candidate, Gate, Sample, best, evaluate

GATE = Gate("read_only_chat", ttft_s=0.5, tpot_s=0.05, e2e_s=4.0, alpha=0.75)


def test_attainment_is_joint_and_conditional_on_admission() -> None:
    samples = [
        Sample(True, 0.2, 0.03, 2.0),  # within all three
        Sample(True, 0.2, 0.03, 3.9),  # within all three
        Sample(True, 0.6, 0.03, 2.0),  # TTFT missed
        Sample(True, 0.2, 0.06, 2.0),  # TPOT missed (each bound alone would pass 3 of 4)
        Sample(False), Sample(False),  # refused: not in the attainment, in the admission rate
    ]
    v = evaluate(GATE, samples)
    assert (v.requests, v.admitted, v.met) == (6, 4, 2)
    assert v.attainment == 0.5 and v.admission_rate == pytest.approx(4 / 6)
    assert not v.eligible and v.reasons == ("attainment 50.0% below 75.0%",)
    assert "admission 66.7% of 6" in str(v)


def test_a_json_answer_and_an_unfinished_request() -> None:
    json_answer = Sample(True, ttft_s=None, tpot_s=None, e2e_s=1.0)  # no token timing: E2E alone
    unfinished = Sample(True, ttft_s=0.1, tpot_s=0.01, e2e_s=None)  # admitted, never finished: missed
    v = evaluate(GATE, [json_answer, unfinished, json_answer, json_answer])
    assert (v.met, v.admitted, v.eligible) == (3, 4, True)


def test_unknown_evidence_and_unmeasured_quality_fail_closed() -> None:
    gate = Gate("c", 1, 1, 1, 0.5, quality_min=0.9, hard=("conformance", "data_residency"))
    good = [Sample(True, 0.1, 0.01, 0.5)]
    assert evaluate(gate, good, 0.95, {"conformance": True, "data_residency": True}).eligible
    v = evaluate(gate, good, None, {"conformance": True})
    assert not v.eligible and set(v.reasons) == {"no evidence for data_residency", "quality not measured"}
    v = evaluate(gate, good, 0.8, {"conformance": False, "data_residency": True})
    assert set(v.reasons) == {"conformance failed", "quality 0.8 below 0.9"}
    assert evaluate(gate, [Sample(False)], 0.95, {"conformance": True, "data_residency": True}).reasons == (
        "no request admitted",)


def test_the_cheapest_is_chosen_only_among_the_eligible() -> None:
    ok = evaluate(GATE, [Sample(True, 0.1, 0.01, 1.0)])
    missed = evaluate(GATE, [Sample(True, 0.9, 0.01, 1.0)])
    cheap_but_slow = Candidate("cheap", [missed], cost_per_accepted_task=0.001, throughput_rps=50)
    fine = Candidate("fine", [ok], cost_per_accepted_task=0.004, throughput_rps=30)
    fast = Candidate("fast", [ok], cost_per_accepted_task=0.006, throughput_rps=80)
    assert best([cheap_but_slow, fine, fast]) is fine
    assert best([cheap_but_slow, fine, fast], "throughput") is fast
    assert best([cheap_but_slow]) is None
    assert best([Candidate("ungated", [], 0.0, 100)]) is None  # no verdicts: nothing shows it holds
