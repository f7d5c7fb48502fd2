"""`llmgw report`'s arithmetic (llmgw/ops/report.py): what it reads from a ledger entry, its percentiles,
budget windows, and a page with no data saying so."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from extproc.config import load_snapshot
from llmgw.bench.stats import percentile
from llmgw.ops.report import reading, render
from tests.conftest import POLICY

NOW = datetime(2026, 12, 15, 12, 0, tzinfo=UTC)


def entry(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "time": NOW.timestamp() - 60, "tenant": "acme", "subject": "acme-demo", "route": "chat-default",
        "request_class": "read_only_chat", "stream": True, "termination": "complete", "settlement": "actual",
        "usage": {"prompt_tokens": 10, "completion_tokens": 11}, "duration_ms": 1200.0, "first_byte_ms": 20.0,
        "first_token_ms": 200.0,
        "attempts": [{"deployment": "pool-llama-8b", "kind": "first"}], "charged_micros": 50, "charged_tokens": 21}
    return {**base, **over}


def test_a_stream_s_tpot_is_the_time_after_its_first_token_per_later_token() -> None:
    r = reading(entry())
    assert (r.ttft_s, r.e2e_s) == (0.2, 1.2)  # the first token's, not the headers' (20 ms)
    assert r.tpot_s is not None and abs(r.tpot_s - 0.1) < 1e-9  # (1.2 - 0.2) / (11 - 1)
    answer = reading(entry(stream=False))
    assert (answer.ttft_s, answer.tpot_s, answer.e2e_s) == (None, None, 1.2)  # no token timing in a JSON answer
    cut = reading(entry(termination="stream_interrupted"))
    assert (cut.ttft_s, cut.tpot_s, cut.e2e_s) == (None, None, None)  # latencies of completed requests only
    before = reading(entry(first_token_ms=None))
    assert (before.ttft_s, before.tpot_s) == (None, None)  # a stream without the first token's time: none
    refused = reading({"time": 1.0, "tenant": "acme", "termination": "refused", "settlement": "none"})
    assert (refused.admitted, refused.route) == (False, "(no route)")


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, p) for p in (50, 95, 99, 100)] == [50.0, 95.0, 99.0, 100.0]
    assert percentile([7.0], 99) == 7.0


def test_a_budget_counts_only_its_window_and_its_scope() -> None:
    snap = load_snapshot(POLICY)
    entries = [entry(charged_micros=3_000_000),  # this month: counts
               entry(time=datetime(2026, 11, 30, tzinfo=UTC).timestamp(), charged_micros=5_000_000),  # last month
               entry(tenant="globex", charged_micros=7_000_000)]  # another tenant
    page, _ = render(entries, snap, now=NOW)
    assert "<td>acme-monthly</td><td>acme</td><td>monthly</td><td>money</td><td>100</td><td>3</td><td>97</td>" in page


def test_an_empty_ledger_says_so_and_draws_nothing() -> None:
    page, report = render([], load_snapshot(POLICY), None, "no metrics URL", now=NOW)
    assert "the ledger holds no entries" in page and "no metrics: no metrics URL" in page
    assert "data:image/png" not in page
    assert sum(s.points for s in report.sections) == 0
