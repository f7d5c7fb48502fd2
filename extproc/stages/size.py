"""Size: a request too large for every candidate's context window can never be served, so it is
refused with 400 `context_length_exceeded` before anything is reserved or counted against a bulkhead
(a 429 would invite retries that can never succeed)."""

from __future__ import annotations

from extproc.bounds import candidate_deployments, fits_some_window, requested_max_tokens
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange


class RequestSize:
    name = "size"

    async def run(self, ex: Exchange) -> None:
        route = ex.route
        if route is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorized route for the size check")
        if fits_some_window(ex.snapshot, route, ex.body):
            return
        per_choice = requested_max_tokens(ex.body, route.max_tokens_cap, ex.snapshot.gateway.limits.default_max_tokens)
        largest = max((d.context_window for d in candidate_deployments(ex.snapshot, route)), default=0)
        param = "max_tokens" if per_choice >= largest else "messages"
        raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"prompt and max_tokens exceed every candidate's context window (largest {largest} "
                           "tokens)", param)
