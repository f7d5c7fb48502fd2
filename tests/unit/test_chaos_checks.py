"""The chaos table's invariant checks (llmgw/chaos/checks.py) on hand-made records: a record set that
holds every invariant, and for each invariant the ways of breaking it that the check must report."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from extproc.config import load_snapshot
from llmgw.chaos.checks import INVARIANTS, Arrival, Evidence, Sent, check_all
from llmgw.render.errors import NOT_PROCESSED
from tests.conftest import POLICY

SNAP = load_snapshot(POLICY)
T0 = 1_800_000_000.0


def good() -> Evidence:
    """A stream the pool answered, a request the pool refused with 503 that the fallback answered, and
    a budget refusal that reached no upstream."""
    stream = Sent("stream", "chat-fallback", "acme", "t1", True, 30_000, started=T0, status=200, request_id="r1",
                  chunks=5, first_chunk_at=T0 + 0.2, finished=True, elapsed_s=0.5)
    fell_back = Sent("fallback", "chat-fallback", "acme", "t2", False, 30_000, started=T0, status=200,
                     request_id="r2", finished=True, elapsed_s=0.3)
    refused = Sent("refused", "chat-default", "globex", "t3", False, 30_000, started=T0, status=429,
                   code="budget_exhausted", request_id="r3", elapsed_s=0.01)
    entries = {
        "t1": [{"request_id": "r1", "data_class": "internal", "settlement": "actual", "termination": "complete",
                "first_byte_ms": 200.0, "duration_ms": 500.0, "attempts": [{"deployment": "pool-llama-8b"}]}],
        "t2": [{"request_id": "r2", "data_class": "internal", "settlement": "actual", "termination": "complete",
                "duration_ms": 300.0, "attempts": [{"deployment": "pool-llama-8b"}, {"deployment": "demo-anthropic"}]}],
        "t3": [{"request_id": "r3", "data_class": "public", "settlement": "none", "termination": "refused",
                "attempts": []}],
    }
    arrivals = {"r1": [Arrival("pool-llama-8b", T0 + 0.05, 200)],
                "r2": [Arrival("pool-llama-8b", T0 + 0.05, 503), Arrival("demo-anthropic", T0 + 0.1, 200)]}
    return Evidence([stream, fell_back, refused], entries, arrivals, set(), {'{budget="globex-daily-tokens"}': 10})


def test_records_that_hold_every_invariant_pass() -> None:
    assert check_all(SNAP, good()) == {i: [] for i in INVARIANTS}


Breaker = Callable[[Evidence], Any]


BREAKS: list[tuple[str, str, Breaker]] = [
    ("3 budget", "below zero", lambda ev: ev.budgets.update({"b": -1})),
    ("3 budget", "refused before dispatch", lambda ev: ev.arrivals.update({"r3": [Arrival("pool-llama-8b", T0, 200)]})),
    ("4 settled once", "still open", lambda ev: ev.open_leases.add("r1")),
    ("4 settled once", "settlement", lambda ev: ev.entries["t1"][0].update(settlement="pending")),
    ("5 deadline", "past a", lambda ev: ev.entries["t2"][0].update(duration_ms=31_000.0)),
    ("5 deadline", "past a", lambda ev: ev.entries["t1"][0].update(first_byte_ms=30_600.0)),
    ("5 deadline", "the client waited", lambda ev: setattr(ev.sent[1], "elapsed_s", 31.0)),
    ("6 retries", "arrivals", lambda ev: ev.arrivals["r2"].append(Arrival("demo-anthropic", T0 + 0.15, 200))),
    ("6 retries", "retried after 400", lambda ev: ev.arrivals.update(
        {"r2": [Arrival("pool-llama-8b", T0, 400), Arrival("demo-anthropic", T0 + 0.1, 200)]})),
    ("6 retries", "effects", lambda ev: (ev.entries["t2"][0].update(effects=["write"]), ev.arrivals.update(
        {"r2": [Arrival("pool-llama-8b", T0, 200), Arrival("demo-anthropic", T0 + 0.1, 200)]}))),
    ("7 fallback", "after the client's first byte", lambda ev: ev.arrivals["r1"].append(
        Arrival("demo-anthropic", T0 + 0.3, 200))),
    ("7 fallback", "without telling the client", lambda ev: setattr(ev.sent[0], "finished", False)),
    ("7 fallback", "not interrupted", lambda ev: (setattr(ev.sent[0], "finished", False),
                                                  setattr(ev.sent[0], "cut", True))),
    ("7 fallback", "not a candidate", lambda ev: ev.entries["t2"][0].update(data_class="restricted")),
    ("8 one record", "0 ledger entries", lambda ev: ev.entries.pop("t3")),
    ("8 one record", "2 ledger entries", lambda ev: ev.entries["t3"].append(dict(ev.entries["t3"][0]))),
    ("8 one record", "the client got", lambda ev: ev.entries["t1"][0].update(request_id="other")),
]


@pytest.mark.parametrize(("invariant", "finding", "breaks"), BREAKS, ids=[f"{i}-{f}" for i, f, _ in BREAKS])
def test_each_way_of_breaking_an_invariant_is_found(invariant: str, finding: str, breaks: Breaker) -> None:
    ev = copy.deepcopy(good())
    breaks(ev)
    found = check_all(SNAP, ev)[invariant]
    assert any(finding in v for v in found), found


def test_a_request_no_worker_took_needs_no_record_but_must_not_reach_an_upstream() -> None:
    ev = good()
    ev.sent.append(Sent("unprocessed", "chat-default", "acme", "t4", False, 30_000, started=T0, status=503,
                        code="policy_unavailable", message=NOT_PROCESSED, request_id="r4"))
    assert check_all(SNAP, ev)["8 one record"] == []
    ev.arrivals["r4"] = [Arrival("pool-llama-8b", T0, 200)]
    assert check_all(SNAP, ev)["8 one record"] == ["unprocessed: not processed by the gateway, yet reached an upstream"]
    # Any other 503 without a record is a lost record.
    ev.sent[-1].message = "the budget store is unavailable"
    assert "unprocessed: 0 ledger entries" in check_all(SNAP, ev)["8 one record"]
