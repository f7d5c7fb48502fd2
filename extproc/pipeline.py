"""The ordered stages and the one runner that times them."""

from __future__ import annotations

import time
from collections.abc import Sequence

from extproc.admission import AdmissionControl
from extproc.decisions import DecisionRecorder
from extproc.exchange import Exchange
from extproc.jwks import JwksCache
from extproc.picker import Picker
from extproc.slices import SliceBook
from extproc.stages import Stage
from extproc.stages.admit import Admission
from extproc.stages.authorize import Authorization
from extproc.stages.budget import BudgetReservation
from extproc.stages.deadline import Deadline
from extproc.stages.identity import CallerIdentity
from extproc.stages.intake import Intake
from extproc.stages.redact import Redaction
from extproc.stages.retry import Retries
from extproc.stages.route import PickEndpoint, PlanRequest, RouteSelection
from extproc.stages.size import RequestSize
from extproc.store import Store


# the decision's steps, in order, all on the one message Envoy sends: the buffered body with the
# headers as attributes. Identity comes first: an unauthenticated caller learns nothing else. Admission
# comes after the route stage's plan and before the plan's request is made (it may drop candidates).
def build_stages(picker: Picker | None = None, jwks: JwksCache | None = None,
                 store: Store | None = None, recorder: DecisionRecorder | None = None,
                 admission: AdmissionControl | None = None, slices: SliceBook | None = None) -> tuple[Stage, ...]:
    """The request stages, with the endpoint picker after routing when the service runs one."""
    stages: tuple[Stage, ...] = (
        CallerIdentity(jwks),
        Intake(),
        Authorization(recorder),
        RequestSize(),
        BudgetReservation(store, admission, slices),
        Redaction(),
        RouteSelection(),
        Admission(admission),
        PlanRequest(),
        Deadline(),
        Retries(),
    )
    return stages if picker is None else (*stages, PickEndpoint(picker))


async def run_stages(stages: Sequence[Stage], ex: Exchange, start: int = 0) -> int | None:
    """Run each stage in order from `start`; a GatewayError from any of them ends the exchange. A stage
    that leaves the request waiting (admission's queue: `ex.waiting`) stops the run: the index to resume
    at is returned, once the caller has waited; None when every stage ran."""
    clock = time.perf_counter
    for i in range(start, len(stages)):
        stage = stages[i]
        t0 = clock()
        try:
            await stage.run(ex)
        finally:
            ex.stage_us[stage.name] = (clock() - t0) * 1e6
        if ex.waiting is not None:
            return i + 1
    return None
