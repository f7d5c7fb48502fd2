"""What is observed of a settlement once the store kept it: its metrics and the request's span."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc import tracing
from extproc.config.schema import Deployment
from extproc.metrics import observe_settlement, observe_tenant
from extproc.settlement.charge import (
    Timing,
)

REASON_LIMIT = 600  # an upstream's reason in the ledger (Envoy's filter bounds it to 500 bytes; escaping grows it)



Observe = Callable[[], None]


@dataclass(frozen=True)
class SettledRequest:
    """What is observed of a settlement the store kept: its metrics and the request's span."""

    dep: Deployment | None
    route: str
    stream: bool
    status: int
    outcome: dict[str, Any]
    request_id: str
    trace: str  # the request's trace context (metadata `trace`), "" when it had none
    revision: str
    start_s: float | None  # epoch seconds of the request's arrival
    timing: Timing
    tenant: str = ""  # set only where the per-tenant metrics are on (gateway.yaml metrics.tenant_label)


def observer(s: SettledRequest) -> Observe:
    return functools.partial(_observe, s)


def _observe(s: SettledRequest) -> None:
    dep = s.dep
    observe_settlement(s.route, dep.deployment if dep else "", dep.provider if dep else "", s.stream, s.status,
                       s.outcome, s.timing)
    if s.tenant:
        observe_tenant(s.tenant, s.route, s.outcome)
    if s.trace and s.start_s is not None:
        usage = s.outcome.get("usage") or {}
        tracing.request_span(s.trace, s.route, s.start_s, s.start_s + (s.timing.duration_s or 0.0), {
            **tracing.request_facts(s.route, s.request_id, s.status, str(s.outcome.get("termination", "")),
                                    dep.serves if dep else "chat"),
            "gen_ai.provider.name": dep.provider if dep else None,
            "gen_ai.response.model": dep.served_model if dep else None,
            "gen_ai.usage.input_tokens": usage.get("prompt_tokens"),
            "gen_ai.usage.output_tokens": usage.get("completion_tokens"),
            "llmgw.route_revision": s.revision, "llmgw.deployment": dep.deployment if dep else None,
            "llmgw.stream": s.stream, "llmgw.settlement": s.outcome.get("settlement"),
            **answer_span_facts(s.outcome)})


def answer_span_facts(outcome: Mapping[str, Any]) -> dict[str, Any]:
    """The answer as the GenAI conventions name it on a span (where a response filter read it): its finish
    reasons and the upstream's id; and which checks it failed."""
    attempt = (outcome.get("attempts") or [{}])[-1]
    finish = attempt.get("finish_reason")
    facts: dict[str, Any] = {}
    if finish:
        facts["gen_ai.response.finish_reasons"] = finish if isinstance(finish, list) else [finish]
    if attempt.get("upstream_id"):
        facts["gen_ai.response.id"] = attempt["upstream_id"]
    checks = outcome.get("answer_checks")
    if isinstance(checks, dict):
        facts["llmgw.answer_checks.failed"] = [f["check"] for f in checks.get("failed") or ()]
    return facts



def swept(rid: str, record: Mapping[str, Any], outcome: dict[str, Any]) -> Observe:
    """The observation of a request the sweeper settled (its worker died with it): counted like any
    settlement, and its request span made from what admission stored, under the span id the request's
    attempts already named as their parent."""
    trace_id, span_id = str(record.get("trace_id", "")), str(record.get("span_id", ""))
    start = record.get("time")
    return observer(SettledRequest(
        None, str(record.get("route", "")), bool(record.get("stream")), 0, outcome, rid,
        tracing.context_value(trace_id, span_id, str(record.get("parent_span_id", ""))) if span_id else "",
        str(record.get("route_revision", "")), start, Timing(None if start is None else time.time() - start)))
