"""A stage whose step of design.md section 1 lands in a later issue. It holds its place in the order
so that the pipeline's shape, timing and tests do not change when it is filled in."""

from __future__ import annotations

from extproc.exchange import Exchange


class BudgetReservation:
    """Atomic reservation, quotas and bulkheads (the budgets issue)."""

    name = "budget"

    async def run(self, ex: Exchange) -> None:
        return None

