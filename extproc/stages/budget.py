"""Budget reservation, quotas, bulkheads and idempotency: one atomic store script before dispatch.

The reservation is the upper bound of invariant 3 (extproc/bounds.py): the prompt's bound plus
max_tokens (or the route's cap) for each of the `n` completions, priced at the most expensive
candidate's price version, so whichever candidate serves, the charge fits. Every budget that
applies (tenant, key or subject, route; daily, monthly, total) must hold it; quotas (requests and
tokens per minute, GCRA) and the tenant's bulkhead (in-flight requests and reserved tokens, as
lease-based permits) are checked in the same script. The reservation carries a lease (deadline, plus
the stream's maximum length for streams, plus grace); a sweeper charges expired leases in full as
`ambiguous` (extproc/settlement/).
"""

from __future__ import annotations

import asyncio
import calendar
import functools
import hashlib
import math
import time
from datetime import UTC, date, datetime
from typing import TypeVar

from extproc.admission import AdmissionControl, PoolGate, Waiter
from extproc.bounds import candidate_deployments
from extproc.contract import RETRY_AFTER_HEADER, ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.metrics import count_admitted
from extproc.replay import Answer
from extproc.reservation import Held
from extproc.slices import SliceBook
from extproc.stages.deadline import effective_deadline_ms
from extproc.stages.retry import ambiguous_retries
from extproc.store import (
    PERIOD_MS,
    BudgetCharge,
    RateCharge,
    Reservation,
    ReserveResult,
    Store,
    StoreUnavailable,
    budget_key,
    idem_key,
    rate_key,
)

# The share of Envoy's wait for a decision after which a worker no longer reserves for it: what is left
# covers the reservation's own round trip and the reply.
LATE_SHARE = 0.75

# Envoy answers a decision that outlasts its message timeout itself (503): reserving for it then is refused.
TOO_LATE = "the decision took longer than Envoy waits for it"

SLICED = ReserveResult("ok")  # admitted from this worker's slice (extproc/slices.py)


class Replay(Exception):
    """A completed request with the same Idempotency-Key and body: answer with its recorded outcome."""

    def __init__(self, answer: Answer):
        super().__init__(answer.status)
        self.answer = answer


def window_id(window: str, now: datetime) -> tuple[str, int]:
    """The calendar window a charge falls in (UTC) and when its key may expire (0 = never)."""
    return _window_id(window, now.date())


@functools.lru_cache(maxsize=64)
def _window_id(window: str, day: date) -> tuple[str, int]:
    now = datetime(day.year, day.month, day.day, tzinfo=UTC)
    if window == "daily":
        end = datetime(now.year, now.month, now.day, tzinfo=UTC).timestamp() + 86_400
        return now.strftime("d%Y%m%d"), int(end) + 7 * 86_400
    if window == "monthly":
        days = calendar.monthrange(now.year, now.month)[1]
        end = datetime(now.year, now.month, 1, tzinfo=UTC).timestamp() + days * 86_400
        return now.strftime("m%Y%m"), int(end) + 35 * 86_400
    return "total", 0


def price_of(ex: Exchange, prompt: int, completion: int) -> tuple[int, str]:
    """(micros, price version) of the bound at the most expensive candidate, so whichever serves (and
    any fallback) fits the reservation."""
    assert ex.route is not None
    micros, version = 0, ""
    for d in candidate_deployments(ex.snapshot, ex.route):
        m = math.ceil(prompt * d.prices.input_per_mtok / 1e6) + math.ceil(completion * d.prices.output_per_mtok / 1e6)
        if m >= micros:
            micros, version = m, d.prices.version
    return micros, version


def lease_until_ms(ex: Exchange) -> int:
    """When what a request holds (its reservation, its pool slot) is taken to be lost: its deadline,
    plus the stream's longest life for a stream, plus the store's grace."""
    assert ex.route is not None
    return (int(ex.arrived_at * 1000) + effective_deadline_ms(ex) + (ex.route.max_stream_ms if ex.stream else 0)
            + ex.snapshot.gateway.store.lease_grace_ms)


T = TypeVar("T")


async def _value(v: T) -> T:
    """What is already known, as one of gather's awaitables."""
    return v


class BudgetReservation:
    name = "budget"

    def __init__(self, store: Store | None = None, admission: AdmissionControl | None = None,
                 slices: SliceBook | None = None):
        self.store = store
        self.admission = admission
        self.slices = slices

    def _early_gate(self, ex: Exchange) -> PoolGate | None:
        """The gate of the pool admission would ask first (the route's first candidate's), when it has
        one: its slot is asked for in the reservation's write, one store round trip instead of two."""
        assert ex.route is not None
        if self.admission is None or ex.shadow_of is not None or not ex.route.candidates:
            return None
        first = ex.snapshot.deployments[ex.route.candidates[0].deployment_name]
        return self.admission.gate_of(ex.snapshot.gateway, first)

    def _sliceable(self, ex: Exchange, r: Reservation) -> bool:
        # A request with an Idempotency-Key needs the store's answer (a replay, a conflict) before it runs.
        return self.slices is not None and ex.snapshot.gateway.store.slice_requests >= 2 and r.idem_key is None

    async def _hold(self, ex: Exchange, r: Reservation) -> tuple[ReserveResult, Reservation]:
        """The reservation: admitted from this worker's slice when it may be (no store round trip; a slice
        taken first when none fits), else reserved in the store on its own. Returns the outcome and the
        reservation as held (a slice's admission names the slice in its hint)."""
        assert self.store is not None
        if (self._sliceable(ex, r) and self.slices is not None and (admitted := await self.slices.admit(
                r, ex.snapshot.gateway.store, "stream" if ex.stream else "json")) is not None):
            return SLICED, admitted
        return await self.store.reserve(r), r

    async def _reserve(self, ex: Exchange, reservation: Reservation) -> tuple[ReserveResult, Reservation]:
        """The reservation, and with it (one write) the first pool's slot. A slot the request will not
        use (the reservation refused, or failed) goes back; the admission stage uses the answer
        (ex.early_slot), and the slot, once granted, rides in the hint like one admission grants."""
        assert self.store is not None and ex.route is not None
        gate = self._early_gate(ex)
        # The common request: its open slices fit it, and nothing is awaited (no turn of the event loop).
        now = (self.slices.admit_now(reservation, "stream" if ex.stream else "json")
               if self._sliceable(ex, reservation) and self.slices is not None else None)
        if gate is None:
            return (SLICED, now) if now is not None else await self._hold(ex, reservation)
        waiter = Waiter.of(ex.snapshot.gateway, ex.route.request_class, reservation.tenant, ex.request_id,
                           reservation.lease_until_ms)
        slot = gate.slot_now(waiter)
        if now is not None and slot:
            ex.early_slot = (gate.pool, True)
            return SLICED, now
        known: tuple[bool, float | None] = (True, None)
        held, asked = await asyncio.gather(_value((SLICED, now)) if now is not None else self._hold(ex, reservation),
                                           _value(known) if slot else gate.ask(waiter), return_exceptions=True)
        granted = not isinstance(asked, BaseException) and asked[0]
        if granted and (isinstance(held, BaseException) or held[0].outcome != "ok"):
            gate.give_back(ex.request_id)
        if isinstance(held, BaseException):
            raise held
        if not isinstance(asked, BaseException):  # a failed ask: admission asks again, and fails closed
            ex.early_slot = (gate.pool, granted)
        return held

    async def run(self, ex: Exchange) -> None:
        route, ident, bound = ex.route, ex.identity, ex.bound
        if route is None or ident is None or bound is None:  # authorization and the size stage come first
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorized route for the reservation")
        if route.budget_reservation == "off":
            return
        if self.store is None:
            if route.budget_reservation == "required":
                raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the budget store is not configured")
            return
        gw = ex.snapshot.gateway
        prompt, tokens = bound.prompt, bound.tokens
        micros, version = price_of(ex, bound.prompt, bound.completion)
        each: tuple[int, int, int, int] | None = None  # one attempt's bounds, when the reservation holds several
        if ex.count:
            # A token count generates nothing and is charged nothing: it holds a reservation of zero (so
            # it is settled, with its one ledger entry, like any request) and counts against the
            # requests-per-minute quotas and the bulkhead, not the token ones.
            micros = tokens = 0
        elif retries := ambiguous_retries(route, ex.effects, ex.idempotency_key is not None):
            # Each attempt that may follow one sent and never answered can be charged too: the earlier one
            # at its bound - a stream's prompt (nothing is generated before its first byte), a JSON
            # answer's whole bound (it is generated before its headers) - so every bound is held.
            extra = (price_of(ex, bound.prompt, 0)[0], prompt) if ex.stream else (micros, tokens)
            each = (micros, tokens, *extra)
            micros, tokens = micros + retries * extra[0], tokens + retries * extra[1]
        now = time.time()
        when = datetime.fromtimestamp(now, UTC)
        # A shadow copy pays from the tenant's shadow budgets only, and takes none of its quotas or
        # bulkhead: the traffic it copies already did.
        shadow = ex.shadow_of is not None
        budgets = []
        for b in gw.budgets:
            if b.matches(ident.tenant, ident.subject, route.route_contract) and (b.traffic == "shadow") == shadow:
                wid, expire = window_id(b.window, when)
                budgets.append(BudgetCharge(budget_key(ident.tenant, b.name, wid), b.limit_micros, b.limit_tokens,
                                            expire))
        if shadow and not budgets:
            raise GatewayError(ErrorCode.BUDGET_EXHAUSTED, "no shadow budget for this tenant and route")
        rates = []
        for q in () if shadow else gw.quotas:
            if q.matches(ident.tenant, ident.subject, route.route_contract):
                if q.requests_per_minute:
                    rates.append(RateCharge(rate_key(ident.tenant, q.name, "rpm"), PERIOD_MS / q.requests_per_minute,
                                            1, False))
                if q.tokens_per_minute:
                    rates.append(RateCharge(rate_key(ident.tenant, q.name, "tpm"), PERIOD_MS / q.tokens_per_minute,
                                            tokens, True))
        bulkhead = gw.tenants[ident.tenant].bulkhead if not shadow else None
        idem = ex.idempotency_key if not ex.count else None  # a count has no outcome to replay
        reservation = Reservation(
            tenant=ident.tenant, rid=ex.request_id, now_ms=int(now * 1000),
            lease_until_ms=lease_until_ms(ex), micros=micros, tokens=tokens,
            budgets=budgets, rates=rates,
            max_in_flight=bulkhead.max_in_flight if bulkhead else None,
            max_in_flight_tokens=bulkhead.max_in_flight_tokens if bulkhead else None,
            record={**ex.ledger_facts(), "prompt_bound": prompt, "max_tokens": bound.per_choice, "n": ex.n,
                    "price_version": version},
            idem_key=idem_key(ident.tenant, ex.idempotency_key_sha256) if idem else None,
            idem_body_hash=hashlib.sha256(ex.raw_body).hexdigest() if idem else "",
            idem_ttl_ms=gw.store.idempotency_ttl_s * 1000, prompt_bound=prompt, attempt_bound=each)
        late_after = gw.envoy.extproc_message_timeout_ms / 1000 * LATE_SHARE
        if time.monotonic() - ex.received_at > late_after:
            # Envoy stops waiting for this decision soon (or did) and answers 503 itself: a reservation
            # made now would be held for a request no upstream will see, until its lease expired and it
            # was charged in full. Refused instead, reserving nothing.
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, TOO_LATE)
        try:
            result, reservation = await self._reserve(ex, reservation)
        except StoreUnavailable as e:
            # The script may have run before its reply was lost (a failover, a timeout): the refusal's
            # ledger entry releases what it may hold (settlement.record_refusal).
            ex.reserve_unknown = True
            if route.budget_reservation == "required":
                raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the budget store is unavailable") from e
            count_admitted(route.route_contract)
            return  # optional: served unmetered, and the log says so
        match result.outcome:
            case "ok":
                count_admitted(route.route_contract)
                ex.held = Held(micros, tokens, prompt, bound.per_choice, ex.n, version, reservation.hint,
                               idem is not None)
                if ex.early_slot is not None and ex.early_slot[1] and self.admission is not None:
                    ex.held = ex.held.with_hint(**self.admission.gates[ex.early_slot[0]].slot_hint(ex.request_id))
            case "budget_exhausted":
                name = budgets[int(result.detail[0]) - 1].key.rsplit(":", 2)[1]
                raise GatewayError(ErrorCode.BUDGET_EXHAUSTED, f"budget {name!r} cannot hold this request's "
                                   f"reservation ({micros} micro-units, {tokens} tokens)")
            case "rate_limited":
                retry = max(1, math.ceil(int(result.detail[0]) / 1000))
                raise GatewayError(ErrorCode.RATE_LIMITED, "quota exceeded; retry later",
                                   headers={RETRY_AFTER_HEADER: str(retry)})
            case "concurrency_limited":
                raise GatewayError(ErrorCode.CONCURRENCY_LIMITED,
                                   f"tenant is at its in-flight limit ({result.detail[0]})",
                                   headers={RETRY_AFTER_HEADER: "1"})
            case "idempotency_conflict":
                # Its answer will be replayed to a retry once it completes: worth coming back for.
                raise GatewayError(ErrorCode.IDEMPOTENCY_CONFLICT, "a request with this Idempotency-Key is in flight",
                                   "Idempotency-Key", headers={RETRY_AFTER_HEADER: "1"})
            case "not_processed":  # Envoy stopped waiting while the reservation was on its way
                raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, TOO_LATE)
            case "idempotency_ambiguous":
                # Dispatching it again could do twice what may have been done once (invariant 21).
                raise GatewayError(ErrorCode.IDEMPOTENCY_AMBIGUOUS,
                                   f"the request with this Idempotency-Key ({result.detail[0] or 'unknown'}) ended "
                                   "without a known outcome and may have run; it is not run again until an operator "
                                   "resolves the key (llmgw ledger resolve --idempotency-key)", "Idempotency-Key")
            case "idempotency_key_reused":
                raise GatewayError(ErrorCode.IDEMPOTENCY_KEY_REUSED,
                                   "this Idempotency-Key was used with a different body", "Idempotency-Key")
            case "replay":
                assert reservation.idem_key is not None
                raise Replay(ex.sealer.open(reservation.idem_key, result.detail[1]))
            case other:
                raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, f"unexpected reservation outcome {other!r}")
