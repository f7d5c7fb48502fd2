"""The decision's own answers (a refusal after it reserved, the route's degraded answer) are released by
the worker that decided them, and Envoy's access log settles them only as the backstop, writing the same
ledger entry: whichever settles first, the ledger says one thing (an admission shed once showed an
attempt with status 429 when the access log won the race)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.config import load_snapshot
from extproc.contract import METADATA_NAMESPACE, ErrorCode, GatewayError
from extproc.exchange import Exchange, Held, Identity
from extproc.names import Key, Settle
from extproc.replies import degraded_answer, refuse
from extproc.settlement import access_log, releases
from extproc.settlement.access_log import SettlementLog
from extproc.settlement.releases import release
from extproc.store import Settlement
from tests.conftest import POLICY

SNAP = load_snapshot(POLICY)


class Captured:
    """A store and a settler that keep what they were asked to settle."""

    def __init__(self) -> None:
        self.settled: list[Settlement] = []

    async def settle(self, s: Settlement) -> None:
        self.settled.append(s)

    def submit(self, s: Settlement, observe: Any = None) -> None:
        self.settled.append(s)


def reserved(admission: str = "") -> Exchange:
    ex = Exchange(snapshot=SNAP, route=SNAP.routes["chat-default"], request_id="rid-1",
                  identity=Identity("acme", "k1", "api_key"),
                  held=Held(100, 64, 32, 32, 1, "v1", '{"b":["k"]}', False))
    ex.admission = admission
    return ex


def logged_as_envoy_would(reply: Any, rid: str) -> Any:
    """The access-log entry of a request the decision answered: Envoy keeps the reply's dynamic metadata,
    its status and its details (the response code details) for the log."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = rid
    entry.response.response_code.value = reply.immediate_response.status.code
    entry.response.response_code_details = reply.immediate_response.details
    entry.common_properties.metadata.filter_metadata[METADATA_NAMESPACE].CopyFrom(
        reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value)
    return entry


def settled_both_ways(ex: Exchange, reply: Any, termination: str, status: int,
                      extra: dict[str, Any] | None = None, backstop_s: float = 0.05) -> tuple[Any, Any, bool]:
    """What the deciding worker's release writes, what the access log's backstop writes, and whether the
    access log had written anything before its backstop time."""
    worker, log = Captured(), Captured()

    async def go() -> bool:
        await release(worker, ex, termination, status, extra)  # type: ignore[arg-type]
        als = SettlementLog(log, lambda: SNAP)  # type: ignore[arg-type]
        als.settle_entry(logged_as_envoy_would(reply, ex.request_id))
        await asyncio.sleep(backstop_s / 2)
        early = bool(log.settled)
        await asyncio.sleep(backstop_s)
        return early

    early = asyncio.run(go())
    (mine,), (backstop,) = worker.settled, log.settled
    return mine, backstop, early


@pytest.mark.parametrize(("err", "termination"), [
    (GatewayError(ErrorCode.OVERLOADED, "pool 'p' is at capacity", headers={"retry-after": "2"}), "refused"),
    (GatewayError(ErrorCode.FORBIDDEN, "data class not allowed"), "denied"),
    (GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "the completion leaves no room"), "refused"),
    # a route's refusal of a field its candidate cannot carry: the entry names the field (issue 44)
    (GatewayError(ErrorCode.UNSUPPORTED_FIELD, "`text.format` cannot be carried", "text.format"), "refused"),
])
def test_a_refusal_after_reserving_is_ledgered_the_same_whoever_settles_it(
        monkeypatch: pytest.MonkeyPatch, err: GatewayError, termination: str) -> None:
    monkeypatch.setattr(access_log, "BACKSTOP_S", 0.05)
    ex = reserved("shed=queue_timeout;queued_ms=1500")
    reply = refuse(ex, err)
    md = reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
    assert md[Key.SETTLE] == Settle.DECIDED and md[Key.HOLD] == ex.held.hint  # type: ignore[union-attr]
    named, marks = releases.refusal(err.code.value, err.param)  # what the worker releases it with
    assert named == termination
    mine, backstop, early = settled_both_ways(ex, reply, termination, err.status, marks)
    assert not early, "the access log settled the decision's own refusal before its backstop time"
    assert mine == backstop
    assert mine.outcome == {"termination": termination, "status": err.status, "settlement": "released",
                       "usage": None, "attempts": [], "admission": "shed=queue_timeout;queued_ms=1500",
                       "error": err.code.value, **({"field": err.param} if err.param else {})}
    assert (mine.micros, mine.tokens) == (0, 0)


def test_the_degraded_answer_is_ledgered_the_same_whoever_settles_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(access_log, "BACKSTOP_S", 0.05)
    ex = reserved()
    reply = degraded_answer(ex, "the service is busy")
    mine, backstop, early = settled_both_ways(ex, reply, releases.DEGRADED_RELEASE[0], 200,
                                              releases.DEGRADED_RELEASE[1])
    assert not early and mine == backstop
    assert mine.outcome == {"termination": "degraded", "status": 200, "settlement": "released", "usage": None,
                           "attempts": [], "degraded": "response"}


def test_an_admitted_request_is_not_settled_as_the_decisions_own_answer() -> None:
    """Only the decision's own answers are DECIDED: an admitted JSON answer settles from the log at once."""
    ex = reserved()
    assert ex.settled_by() is Settle.ACCESS_LOG
    assert ex.metadata()[Key.SETTLE] == Settle.ACCESS_LOG
