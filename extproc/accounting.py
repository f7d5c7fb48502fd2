"""Accounting as pure functions (no I/O, no Envoy types): what a settlement charges and how the
ledger names the ending. extproc/settlement.py gathers the facts (from the access log or a response
filter) and calls these; tests/unit/test_accounting.py tables them."""

from __future__ import annotations

import math
from typing import Any

from extproc.adapters.base import is_count
from extproc.config import Snapshot
from extproc.config.schema import Deployment, Prices
from extproc.fallback import decode_plan

Usage = dict[str, Any]


def answered_by(snap: Snapshot, first: str, plan: str, answered: str) -> Deployment | None:
    """The deployment whose prices apply: on a fallback route the candidate the attempt filter named,
    if the plan holds it (an upstream cannot name a pricier one); otherwise the first candidate."""
    if plan and answered and answered in decode_plan(plan)[1]:
        return snap.deployments.get(answered)
    return snap.deployments.get(first)


def first_byte_ms(arrived_at: float | None, first_at: float) -> float | None:
    """From the request's arrival at Envoy (`request.time`, extproc/clocks.py) to its answer's first byte."""
    return None if arrived_at is None else round((first_at - arrived_at) * 1000, 1)


def charge_of(usage: dict[str, Any], prices: Prices) -> tuple[int, int]:
    """(micro-units, tokens) for a usage object: cached prompt tokens at the cached price."""
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = min(prompt, int(details.get("cached_tokens") or 0)) if isinstance(details, dict) else 0
    micros = math.ceil(((prompt - cached) * prices.input_per_mtok + cached * prices.cached_input_per_mtok
                        + completion * prices.output_per_mtok) / 1e6)
    return micros, prompt + completion


def termination_of(status: int, complete: bool) -> str:
    if status == 504:
        return "deadline"
    if status >= 400:
        return "upstream_error"
    return "complete" if complete else "stream_interrupted"


def estimated(prompt: int, completion: int) -> Usage:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def upstream_succeeded(recorded: str, answered: bool) -> bool:
    """Whether the upstream's own answer was a 2xx: the status the Lua filter nearest the router
    recorded when the answer's headers came (`upstream_status`), believed only when an upstream did
    send headers (`answered`) - without them the status is one Envoy made up itself (its timeout, its
    degraded answer), which the same filter also sees."""
    return answered and recorded.isdigit() and 200 <= int(recorded) < 300


def failure_charge(*, stream: bool, sent: bool, answered: bool, prompt_bound: int,
                   succeeded: bool = False) -> tuple[Usage | None, str]:
    """(usage to charge, settlement kind) for an answer that produced no usage: see the module's
    docstring. `sent`: the upstream got the request; `answered`: it sent response headers;
    `succeeded`: those headers were a 2xx (upstream_succeeded) - whatever Envoy then did to the
    answer (a body too large to read, a body that stalled past the deadline), the upstream did the
    work it was asked."""
    if not sent or (answered and not succeeded):  # never reached an upstream, or it refused with an error
        return None, "released"
    if stream:  # a stream's first byte is its first token: nothing was generated before it
        return estimated(prompt_bound, 0), "partial"
    return None, "ambiguous"  # a JSON answer is generated before its headers: it may all have been


def believable(usage: Usage) -> bool:
    """Whether every count in an upstream's usage is one (adapters.base.is_count); usage that is not
    is not believed (unknown)."""
    details = usage.get("prompt_tokens_details") or {}
    counts = [usage.get("prompt_tokens"), usage.get("completion_tokens"),
              details.get("cached_tokens") if isinstance(details, dict) else None]
    return all(c is None or is_count(c) for c in counts)


def believed(usage: Usage | None, source: str) -> tuple[Usage | None, str]:
    """The usage to charge and record, and its source: usage with a count no upstream gives is none,
    from the source `unbelievable` - kept out of the ledger, the metrics and the cost exports, which
    sum it (a negative count there would be a refund too)."""
    if usage and not believable(usage):
        return None, "unbelievable"
    return usage, source


def charge_for(usage: Usage | None, source: str, termination: str, status: int, dep: Deployment | None,
               failed: str = "released") -> tuple[int, int, str]:
    """(micros, tokens, settlement kind) of usage already believed (`believed`, which settlement
    calls once for the charge and the record): actual usage when reported (or estimated); -1 (the
    whole reservation) when the engine may have worked but its usage is unknown - or was not
    believable; else the kind a failure without usage settles as (failure_charge's): the whole
    reservation when `ambiguous`, else nothing."""
    if usage and dep is not None:
        micros, tokens = charge_of(usage, dep.prices)
        return micros, tokens, "actual" if termination == "complete" and source == "reported" else "partial"
    if 200 <= status < 300 or failed == "ambiguous":
        return -1, -1, "ambiguous"
    return 0, 0, failed


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def outcome_of(termination: str, status: int, kind: str, usage: Usage | None, source: str,
               dep: Deployment | None, redactions: str, attempt: dict[str, Any],
               duration_s: float | None = None, first_byte_s: float | None = None,
               marks: dict[str, str] | None = None) -> dict[str, Any]:
    """The settlement half of a ledger entry (the admission half is stored with the reservation).
    `duration_s` and `first_byte_s` run from the request's arrival to its answer's last and first
    byte to the client (None when not known); `llmgw report` reads its latencies from them."""
    return {"termination": termination, "status": status, "settlement": kind, "usage": usage,
            **{k: v for k, v in (marks or {}).items() if v},  # degraded, canary: what served it, and why
            "duration_ms": _ms(duration_s), "first_byte_ms": _ms(first_byte_s),
            "usage_source": source, "price_version": dep.prices.version if dep else "", "redactions": redactions,
            "attempts": [{"deployment": dep.deployment if dep else "",
                          "adapter": dep.fingerprint.adapter if dep else "", "status": status, **attempt}]}
