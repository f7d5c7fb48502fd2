"""Deadline: effective deadline = min(`x-llmgw-deadline-ms`, the route's `deadline_ms`), counted from
the request's arrival at Envoy (invariant 5). What remains goes to Envoy's router through metadata: as
the whole-request timeout, or for a stream as the time to the response headers (the stream itself is
bounded by idle and duration limits, not by the deadline). The router passes it upstream as
`x-envoy-expected-rq-timeout-ms`, so the engine knows how long it has.
"""

from __future__ import annotations

import time

from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange

HEADER = "x-llmgw-deadline-ms"


def requested_deadline_ms(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or not 0 < int(value) <= 86_400_000:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{HEADER} must be a positive integer of milliseconds",
                           HEADER)
    return int(value)


class Deadline:
    name = "deadline"

    async def run(self, ex: Exchange) -> None:
        if ex.route is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no route for the deadline")
        requested = requested_deadline_ms(ex.headers.get(HEADER))
        effective = ex.route.deadline_ms if requested is None else min(requested, ex.route.deadline_ms)
        elapsed_ms = max(0.0, (time.time() - ex.arrived_at) * 1000)
        remaining = int(effective - elapsed_ms)
        if remaining <= 0:
            raise GatewayError(ErrorCode.DEADLINE_EXCEEDED, "the deadline ran out before dispatch")
        ex.remaining_ms = remaining
