"""The pipeline: one small stage per step of the decision (identity, authorization, budget,
redaction, route, admission, the plan's request, deadline, retries, endpoint pick), run in this order.

A stage either returns (having mutated the Exchange) or raises GatewayError, which ends the exchange
with the contract's JSON error. The runner in extproc.pipeline times every stage.
"""

from __future__ import annotations

from typing import Protocol

from extproc.exchange import Exchange


class Stage(Protocol):
    name: str

    async def run(self, ex: Exchange) -> None: ...
