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


def effective_deadline_ms(ex: Exchange) -> int:
    """min(the caller's x-llmgw-deadline-ms, the route's deadline_ms)."""
    assert ex.route is not None
    return ex.route.deadline_ms if ex.deadline_ms is None else min(ex.deadline_ms, ex.route.deadline_ms)


class Deadline:
    name = "deadline"

    async def run(self, ex: Exchange) -> None:
        if ex.route is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no route for the deadline")
        effective = effective_deadline_ms(ex)
        elapsed_ms = max(0.0, (time.time() - ex.arrived_at) * 1000)
        remaining = int(effective - elapsed_ms)
        if remaining <= 0:
            raise GatewayError(ErrorCode.DEADLINE_EXCEEDED, "the deadline ran out before dispatch")
        ex.remaining_ms = remaining
