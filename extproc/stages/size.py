"""Size: a request too large for every candidate's context window can never be served, so it is
refused with 400 `context_length_exceeded` before anything is reserved or counted against a bulkhead
(a 429 would invite retries that can never succeed)."""

from __future__ import annotations

from extproc.bounds import bound_of, candidate_deployments, fits_some_window
from extproc.contract import ErrorCode, GatewayError
from extproc.embeddings import longest_input
from extproc.exchange import Exchange


class RequestSize:
    name = "size"

    async def run(self, ex: Exchange) -> None:
        route = ex.route
        if route is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorized route for the size check")
        ex.bound = bound_of(ex.snapshot, route, ex.body, ex.n, ex.operation == "chat")  # the reservation's too
        if ex.operation == "embeddings":  # each input is a sequence of its own: the longest must fit
            if fits_some_window(ex.snapshot, route, bound_of(ex.snapshot, route, longest_input(ex.body), 1, False)):
                return
            raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "an input exceeds every candidate's context window",
                               "input")
        if fits_some_window(ex.snapshot, route, ex.bound):
            return
        largest = max((d.context_window for d in candidate_deployments(ex.snapshot, route)), default=0)
        param = "max_tokens" if ex.bound.per_choice >= largest else "messages"
        raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"prompt and max_tokens exceed every candidate's context window (largest {largest} "
                           "tokens)", param)
