"""Admission (extproc/admission.py): the plan's first candidate with room - a pool slot, a provider
quota - is where the request goes; none has room: it waits for the first pool's slot, or is refused
with 429 `overloaded` and Retry-After. Runs between the route stage (the plan) and the plan's request
(stages/route.py: PlanRequest), so a candidate passed over is never sent anything.

Only requests that hold a reservation are admitted here: settlement, which gives a slot or an unused
quota back, settles reservations (a route with `budget_reservation: off`, or one served unmetered while
the store is down, is not held back). Token counts generate nothing and shadow copies are bounded by
their own budgets: neither is admitted here.
"""

from __future__ import annotations

import math
import time
from typing import Any

from extproc.admission import AdmissionControl, PoolGate, Waiter, Waiting
from extproc.config.schema import Deployment
from extproc.contract import RETRY_AFTER_HEADER, ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.metrics import count_admission
from extproc.stages.budget import lease_until_ms
from extproc.stages.deadline import effective_deadline_ms
from extproc.store import StoreUnavailable

ANSWER_MARGIN_S = 0.05  # of the deadline, kept for the rest of the decision after a wait


def with_hint(ex: Exchange, **extra: Any) -> None:
    """What settlement gives back beside the reservation, added to the hint Envoy's metadata carries."""
    assert ex.held is not None
    ex.held = ex.held.with_hint(**extra)


def _start_at(ex: Exchange, k: int) -> None:
    """The plan starts at candidate k: the ones before it (no room) are never sent anything."""
    if k:
        ex.candidates, ex.plan = ex.candidates[k:], ex.plan.starting_at(k)


class Admission:
    name = "admission"

    def __init__(self, control: AdmissionControl | None = None):
        self.control = control

    async def run(self, ex: Exchange) -> None:
        control, plan, route = self.control, ex.plan, ex.route
        if control is None or plan is None or route is None or ex.held is None or ex.shadow_of is not None:
            return
        gw = ex.snapshot.gateway
        rc = gw.request_classes.get(route.request_class)
        ttl_ms = rc.queue_ttl_ms if rc is not None else 0
        lease = lease_until_ms(ex)
        tenant = ex.identity.tenant if ex.identity is not None else ""

        def waiter() -> Waiter:
            return Waiter.of(gw, route.request_class, tenant, ex.request_id, lease)

        skipped: list[str] = []
        quota_wait_ms: list[int] = []
        early, ex.early_slot = ex.early_slot, None
        if early is not None and early[1] and (not ex.candidates or ex.candidates[0].pool != early[0]):
            # The plan does not start at the pool the reservation's write asked a slot of: it goes back.
            with_hint(ex, a=None, m=None)
            control.gates[early[0]].give_back(ex.request_id)
        try:
            for k, dep in enumerate(ex.candidates):
                gate = control.gate_of(gw, dep)
                if gate is not None:
                    asked = (early[1] if early is not None and k == 0 and early[0] == gate.pool
                             else (await gate.ask(waiter()))[0])
                    if asked:  # room now, and nobody waits for it
                        self._admitted(ex, k, skipped, gate)
                        return
                    skipped.append(f"{dep.deployment}:overloaded")
                elif dep.provider_quota is not None:
                    wait_ms = await self._reserve_quota(ex, dep)
                    if wait_ms is None:
                        self._admitted(ex, k, skipped, None)
                        return
                    skipped.append(f"{dep.deployment}:provider_quota")
                    quota_wait_ms.append(wait_ms)
                    count_admission(dep.deployment, route.request_class, "shed_quota")
                else:
                    self._admitted(ex, k, skipped, None)
                    return
            first = next(((k, d.pool) for k, d in enumerate(ex.candidates) if d.pool is not None
                          and gw.pools[d.pool].admission is not None), None)
            if first is None:  # every candidate's provider quota is spent
                ex.admission = "skipped=" + ",".join(skipped)
                retry = max(1, math.ceil(min(quota_wait_ms) / 1000))
                raise GatewayError(ErrorCode.OVERLOADED, "the provider quota of every candidate of route "
                                   f"{route.route_contract!r} is spent for now",
                                   headers={RETRY_AFTER_HEADER: str(retry)})
            # None has room: wait in the first pool's queue, as long as the class allows and the deadline leaves.
            k, pool = first
            gate = control.gates[pool]
            remaining_s = (effective_deadline_ms(ex) / 1000 - (time.time() - ex.arrived_at)) - ANSWER_MARGIN_S
            wait_s = min(ttl_ms / 1000, remaining_s)
            w = waiter()
            ok, start = await gate.ask(w, int((time.time() + wait_s) * 1000) if wait_s > 0 else 0)
        except StoreUnavailable as e:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the admission store is unavailable") from e
        if ok:  # first in the queue, and a slot was free
            self._queued(ex, k, gate, w)
            return
        if start is None:
            raise self._shed(ex, gate, "no_wait", 0.0)
        w.start = start
        if not gate.wait(w):
            gate.leave(w)
            raise self._shed(ex, gate, "queue_full", 0.0)
        ex.waiting = Waiting(gate, w, wait_s, on_admitted=lambda: self._queued(ex, k, gate, w),
                             on_shed=lambda waited: self._shed(ex, gate, "queue_timeout", waited))

    def _admitted(self, ex: Exchange, k: int, skipped: list[str], gate: PoolGate | None) -> None:
        """Candidate k has room: the plan starts there; what it holds is named in the hint."""
        assert ex.route is not None
        dep = ex.candidates[k]
        _start_at(ex, k)
        if k:
            ex.admission = "skipped=" + ",".join(skipped)
        if gate is not None:
            with_hint(ex, **gate.slot_hint(ex.request_id))
        count_admission(gate.pool if gate is not None else dep.deployment, ex.route.request_class,
                        "next_candidate" if k else "admitted")

    def _queued(self, ex: Exchange, k: int, gate: PoolGate, w: Waiter) -> None:
        assert ex.route is not None
        waited = time.monotonic() - w.enqueued
        _start_at(ex, k)
        ex.admission = f"queued_ms={round(waited * 1000)}"
        with_hint(ex, **gate.slot_hint(ex.request_id))
        count_admission(gate.pool, ex.route.request_class, "queued_admitted", waited)

    @staticmethod
    def _shed(ex: Exchange, gate: PoolGate, why: str, waited: float) -> GatewayError:
        assert ex.route is not None
        ex.admission = f"shed={why};queued_ms={round(waited * 1000)}"
        count_admission(gate.pool, ex.route.request_class, f"shed_{why}", waited)
        return GatewayError(ErrorCode.OVERLOADED, f"pool {gate.pool!r} is at capacity"
                            + (f" (waited {waited:.1f} s)" if waited else ""),
                            headers={RETRY_AFTER_HEADER: str(gate.retry_after_s())})

    async def _reserve_quota(self, ex: Exchange, dep: Deployment) -> int | None:
        """The deployment's provider quota (and the tenant's share of it) reserved: None; else how long
        until it has room (ms)."""
        assert self.control is not None and ex.held is not None and ex.identity is not None
        charges, wait_ms = await self.control.provider_quota(ex.snapshot.gateway, dep, ex.identity.tenant,
                                                             ex.held.tokens)
        if wait_ms is None and charges:
            with_hint(ex, q=[c.encode() for c in charges])
        return wait_ms
