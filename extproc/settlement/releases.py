"""Requests that end before any upstream answers: released (a refusal after the reservation, the
route's degraded answer) or, holding no reservation, given their one ledger entry."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from extproc.contract import ErrorCode
from extproc.exchange import Exchange
from extproc.replies import DEGRADED_DETAILS, REPLY_PREFIX
from extproc.settlement.settler import RETRY_EVERY_S, RETRY_FOR_S, store_down
from extproc.store import Settlement, Store, StoreUnavailable


def released(termination: str, status: int, admission: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settlement of a reserved request that ended before dispatch: nothing spent, no attempt; how
    admission let it through, or why it shed it (ledger_facts holds it for the rest)."""
    return {"termination": termination, "status": status, "settlement": "released", "usage": None,
            "attempts": [], **(extra or {}), **({"admission": admission} if admission else {})}


def refused_termination(code: str) -> str:
    """A refusal's termination in the ledger: `denied` by policy, `refused` for every other reason."""
    return "denied" if code == ErrorCode.FORBIDDEN.value else "refused"


DEGRADED_RELEASE = ("degraded", {"degraded": "response"})  # the route's degraded answer: released, marked


def refusal_marks(code: str, field: str | None) -> dict[str, Any]:
    """What a refusal's ledger entry says of it: the contract's code, and the field it names as the
    caller wrote it (an unsupported or invalid one), where it names one."""
    return {"error": code, **({"field": field} if field else {})}


def refusal(code: str, field: str | None) -> tuple[str, dict[str, Any]]:
    """A refusal's termination and its marks (refusal_marks)."""
    return refused_termination(code), refusal_marks(code, field)


def decided_release(details: str, field: str) -> tuple[str, dict[str, Any]]:
    """The termination (and marks) of the decision's own answer, from the details it gave Envoy and the
    field its metadata names."""
    if details == DEGRADED_DETAILS:
        return DEGRADED_RELEASE
    return refusal(details.removeprefix(REPLY_PREFIX), field)


async def release(store: Store | None, ex: Exchange, termination: str, status: int,
                  extra: dict[str, Any] | None = None) -> None:
    """A reserved request ended before dispatch: nothing was spent."""
    if store is None or ex.held is None or ex.identity is None:
        return
    outcome = released(termination, status, ex.admission, extra)
    try:
        await store.settle(Settlement(ex.identity.tenant, ex.request_id, outcome, 0, 0, hint=ex.held.hint))
    except StoreUnavailable:
        store_down.error("request %s: reservation not released (store unavailable); the sweeper will settle it",
                          ex.request_id)


async def record_refusal(store: Store | None, ex: Exchange, termination: str, status: int, code: str,
                         field: str | None = None) -> None:
    """The ledger entry of an authenticated request that holds no reservation (denied, refused). A store
    that does not answer is tried again every RETRY_EVERY_S for RETRY_FOR_S, as settlements are; the
    append is once-only, so a retry after a lost reply adds nothing."""
    if store is None or ex.identity is None or ex.held is not None:
        return
    outcome = {"termination": termination, "status": status, **refusal_marks(code, field), "settlement": "none",
               "usage": None, "attempts": []}
    facts, tenant = ex.ledger_facts(), ex.identity.tenant
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            # A reserve whose reply was lost may have run: its reservation is released at nothing and
            # its settlement is the request's one entry. Otherwise the refusal's entry, once; its marker
            # also refuses a reserve of this request that runs late.
            if ex.reserve_unknown and await store.settle(
                    Settlement(tenant, ex.request_id, {**outcome, "settlement": "released"}, 0, 0)) is not None:
                return
            await store.append_ledger(tenant, ex.request_id, facts, outcome)
            return
        except StoreUnavailable:
            if time.monotonic() >= give_up:
                store_down.error("request %s: ledger entry lost (store unavailable for %.0f s)", ex.request_id,
                                  RETRY_FOR_S)
                return
            await asyncio.sleep(RETRY_EVERY_S)
