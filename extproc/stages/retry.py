"""Retry policy per request (invariant 6). Envoy's router is the one retry owner; this stage only
decides what it may do for this request, and the request-side header mutation hands that to the
router as `x-envoy-retry-on`, `x-envoy-retriable-status-codes` and `x-envoy-max-retries` (the
client's own values are overwritten).

- Eligible failures come from the route: `connect_before_send` (connect failure, refused stream,
  reset before the request was sent), `rate_limited` (429), `overloaded` (529), `unavailable` (503),
  `no_first_byte` (the per-try limit passed, or a reset, before the response headers).
  400, 401 and 403 are never in the list, so they are never retried.
- A request with effects (a tool whose catalog entry has effects) is retried only with an
  `Idempotency-Key`; `requires: idempotency_key` demands one always; `never` turns retries off.
- Even with a key, a request with effects is never retried after it may have been acted on: a
  timeout or reset after it was sent (`no_first_byte`) is an ambiguous outcome, not proof that no
  work occurred, and the key means nothing to the upstream (it is the gateway's, for replays). Only
  failures that prove the upstream did nothing - no connection, or an error status it answered -
  move it on. The ambiguous attempt ends the request (504 or 502) and its ledger entry names the
  Idempotency-Key, so the caller reconciles instead of the gateway re-sending the action elsewhere.
- The route's `retry.attempts` is how many retries may follow the first attempt. With one qualified
  candidate a retry goes to another engine of it (transport retry); with several, to the next
  candidate (failover or model fallback), and once all were tried, to the last one again. All attempts share
  the one deadline: the router's timeout is the remaining time; a stream has no whole-request
  timeout, so its per-try limit (time to headers) is the remaining time divided among the attempts.
"""

from __future__ import annotations

from extproc.config.schema import Route
from extproc.exchange import Exchange

RETRY_ON = {
    "connect_before_send": "connect-failure,refused-stream,reset-before-request",
    "rate_limited": "retriable-status-codes",
    "overloaded": "retriable-status-codes",
    "unavailable": "retriable-status-codes",
    # No response headers within the per-try limit (a stream's time to first byte), or a reset before
    # them: nothing reached the client yet.
    "no_first_byte": "reset",
}
AMBIGUOUS = ("no_first_byte",)  # the request was sent; the upstream may have acted on it
STATUS_CODES = {"rate_limited": "429", "overloaded": "529", "unavailable": "503"}


def eligible_failures(route: Route, effects: tuple[str, ...], keyed: bool) -> tuple[str, ...]:
    """The failures this request's attempts may be retried after (empty: none), by its route's policy:
    only with the key the policy requires, and never after an ambiguous failure for a request with
    effects."""
    policy = route.retry
    allowed = {"never": False, "idempotency_key": keyed,
               "read_only_or_idempotency_key": keyed or not effects}[policy.requires]
    if not allowed or policy.attempts < 1:
        return ()
    return tuple(f for f in policy.eligible_failures if not (effects and f in AMBIGUOUS))


def ambiguous_retries(route: Route, effects: tuple[str, ...], keyed: bool) -> int:
    """How many attempts may follow one that was sent and never answered (a reset, or no first byte
    within its limit): each such attempt may have run, and is charged at its bound (invariant 23), so
    the reservation holds one bound more for each (extproc/stages/budget.py)."""
    return route.retry.attempts if any(f in AMBIGUOUS for f in eligible_failures(route, effects, keyed)) else 0


class Retries:
    name = "retry"

    async def run(self, ex: Exchange) -> None:
        route = ex.route
        if route is None:
            return
        eligible = eligible_failures(route, ex.effects, ex.idempotency_key is not None)
        if not eligible:
            ex.retry_on, ex.max_retries, ex.retriable_codes = "", 0, ""
            return
        ex.retry_on = ",".join(dict.fromkeys(part for f in eligible for part in RETRY_ON[f].split(",")))
        ex.retriable_codes = ",".join(STATUS_CODES[f] for f in eligible if f in STATUS_CODES)
        ex.max_retries = route.retry.attempts
        if ex.stream and ex.remaining_ms:
            ex.remaining_ms = max(1, ex.remaining_ms // (ex.max_retries + 1))
