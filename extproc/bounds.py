"""Invariant 3's bound: the most tokens a request can cost, whichever candidate serves it.

prompt = UTF-8 bytes of everything the template renders (extproc/chat.py) + the largest per-message
template allowance among the route's candidates; completion = max_tokens (the route's cap, or the
gateway default, when the client named none) for each of the `n` completions. Reservation, the
context-window checks and the limit the engine is told all use these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.chat import prompt_bytes
from extproc.config import Snapshot
from extproc.config.schema import Deployment, Route
from extproc.contract import ErrorCode, GatewayError
from extproc.reservation import Held


def requested_max_tokens(body: dict[str, Any], route_cap: int | None, default: int) -> int:
    """Tokens one completion may run to: the client's limit, else the route's cap, else the default."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if value else (route_cap or default)


def candidate_deployments(snap: Snapshot, route: Route) -> list[Deployment]:
    return [d for c in route.candidates if (d := snap.deployments.get(c.deployment_name)) is not None]


def template_allowance(snap: Snapshot, route: Route) -> int:
    """The largest per-message template allowance among the route's candidates, so the bound holds
    whichever candidate serves."""
    return max((d.template_allowance_tokens for d in candidate_deployments(snap, route)), default=0)


@dataclass(frozen=True, slots=True)
class Bound:
    """Computed once per request, before anything is reserved (stages/size.py)."""

    text: int  # UTF-8 bytes of what the template renders
    messages: int
    allowance: int  # the largest per-message template allowance among the route's candidates
    per_choice: int  # max tokens of one completion
    n: int  # completions

    @property
    def prompt(self) -> int:
        return self.text + self.allowance * self.messages

    @property
    def completion(self) -> int:
        return self.per_choice * self.n

    @property
    def tokens(self) -> int:
        return self.prompt + self.completion


# What redaction may add to each input of a request that generates nothing (a placeholder longer than
# the value it replaces): a chat completion takes such growth from its completion tokens, an
# embeddings request has none to take it from, so it reserves this much more per input.
REDACTION_SLACK_TOKENS = 16


def bound_of(snap: Snapshot, route: Route, body: dict[str, Any], n: int, generates: bool = True) -> Bound:
    """The request's bound; one that generates nothing (embeddings) has no completion tokens, and
    room per input for what redaction may add."""
    if not generates:
        return Bound(prompt_bytes(body), len(body.get("messages") or ()),
                     template_allowance(snap, route) + REDACTION_SLACK_TOKENS, 0, n)
    per_choice = requested_max_tokens(body, route.max_tokens_cap, snap.gateway.limits.default_max_tokens)
    return Bound(prompt_bytes(body), len(body.get("messages") or ()), template_allowance(snap, route), per_choice, n)


def fits_some_window(snap: Snapshot, route: Route, bound: Bound) -> bool:
    """Whether prompt + one completion fits the context window of at least one of the route's
    candidates (each with its own template allowance). A request that fits none can never be served."""
    return any(bound.text + d.template_allowance_tokens * bound.messages + bound.per_choice <= d.context_window
               for d in candidate_deployments(snap, route))


def inputs_fit(held: Held | None, prompt_bound: int) -> None:
    """A request that generates nothing (embeddings): what redaction added to its inputs must fit the
    room its reservation holds for it (REDACTION_SLACK_TOKENS), as it has no completion to take the
    growth from (invariant 3; `completion_limit` is the chat completion's twin)."""
    if held is not None and prompt_bound > held.prompt_bound:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "redaction made the inputs longer than the reservation made "
                           "for them: split them into smaller requests", "input")


def completion_limit(held: Held | None, requested: int, prompt_bound: int) -> int:
    """The max tokens the upstream is told for each completion: what was reserved per completion (the
    route's cap when the client named none, so the engine cannot run past the reservation), less this
    completion's share of whatever redaction added to the prompt bound since (a placeholder can be
    longer than the value it replaces)."""
    if held is None:
        return requested
    grown = max(0, prompt_bound - held.prompt_bound)
    limit = held.max_tokens - -(-grown // held.n)  # ceil: n completions pay for the growth together
    if limit < 1:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "the redacted prompt leaves no room for completion "
                           "tokens within the request's reservation; ask for more max_tokens", "max_tokens")
    return limit
