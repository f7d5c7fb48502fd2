"""Invariants 3 to 8 (docs/INVARIANTS.md), checked after a fault from what the gateway and the engines
recorded: the ledger (one entry per request, its attempts and settlement), the engines' and
providers' request logs (every arrival, with the gateway's request id and the time it came), the
store's leases and budgets, and what the client saw. Pure functions of those records, so each check
is tested on hand-made records that break it (tests/unit/test_chaos_checks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.config import Snapshot
from llmgw.render.errors import NOT_PROCESSED

INVARIANTS = ("3 budget", "4 settled once", "5 deadline", "6 retries", "7 fallback", "8 one record")
# Slack on time bounds: Envoy's and the store's own steps after a timer fires, on a loaded machine.
DEADLINE_SLACK_MS = 400.0
# "none": refused before reserving; "released": nothing spent; "ambiguous": charged in full.
SETTLEMENTS = {"actual", "partial", "released", "ambiguous", "none"}
NEVER_RETRIED = {400, 401, 403}


@dataclass
class Sent:
    """One request the chaos client sent, and what it saw."""

    label: str
    route: str
    tenant: str
    trace_id: str  # the client's traceparent: how its ledger entry is found
    stream: bool
    deadline_ms: int  # the effective deadline: min(route, the caller's header)
    started: float = 0.0  # wall clock (time.time()) at send
    status: int = 0  # 0: no answer (connection failed or cancelled before headers)
    code: str = ""  # the contract's error code of an error answer or a stream's error event
    message: str = ""  # an error answer's message
    request_id: str = ""
    chunks: int = 0  # content chunks of a stream
    first_chunk_at: float | None = None  # wall clock of the first content chunk
    finished: bool = False  # a complete answer: JSON, or a stream that reached [DONE] without an error
    error_event: bool = False  # the stream ended with the contract's error event
    cut: bool = False  # the stream's connection ended without [DONE] or an error event
    cancelled: bool = False  # the client gave up on purpose
    elapsed_s: float = 0.0
    deployment: str = ""  # x-llmgw-deployment
    idempotency_key: str | None = None

    @property
    def unprocessed(self) -> bool:
        """Envoy's own answer when no ext_proc worker took the request: never authenticated, so the
        ledger has no record of it (invariant 8 is about authenticated requests)."""
        return self.status == 503 and self.message == NOT_PROCESSED

    @property
    def visible_failure(self) -> bool:
        """The client can tell this answer failed: an error status, an error event, or a cut."""
        return self.status >= 400 or self.error_event or self.cut or self.status == 0


@dataclass(frozen=True)
class Arrival:
    """One request as an engine or provider logged it."""

    deployment: str
    at: float  # wall clock
    status: int


@dataclass
class Evidence:
    sent: list[Sent]
    entries: dict[str, list[dict[str, Any]]]  # trace id -> ledger entries with it
    arrivals: dict[str, list[Arrival]]  # gateway request id -> arrivals, in time order
    open_leases: set[str]  # request ids the store still holds a reservation for
    budgets: dict[str, int] = field(default_factory=dict)  # budget -> what remains (limit - settled - reserved)


Check = Callable[[Snapshot, Evidence], list[str]]  # the violations found (empty: held)


def _entry(ev: Evidence, s: Sent) -> dict[str, Any] | None:
    found = ev.entries.get(s.trace_id) or []
    return found[0] if len(found) == 1 else None


def _rid(ev: Evidence, s: Sent) -> str:
    e = _entry(ev, s)
    return str(e.get("request_id") or "") if e else s.request_id


def budget(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 3: no budget has less than nothing left, and a request refused before dispatch (never
    reserved, or released with no attempt) reached no upstream."""
    out = [f"budget {b}: {left} below zero (settled + reserved > limit)" for b, left in ev.budgets.items() if left < 0]
    for s in ev.sent:
        e = _entry(ev, s)
        before = e is not None and (e.get("settlement") == "none" or
                                    (e.get("settlement") == "released" and not e.get("attempts")))
        if e is not None and before and ev.arrivals.get(str(e.get("request_id"))):
            out.append(f"{s.label}: refused before dispatch ({e.get('status')}) yet reached an upstream")
    return out


def settled_once(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 4: every reservation settled (none held after the fault), with a known settlement."""
    out = []
    for s in ev.sent:
        e = _entry(ev, s)
        if e is None:
            continue  # invariant 8's finding
        if e.get("settlement") not in SETTLEMENTS:
            out.append(f"{s.label}: settlement {e.get('settlement')!r}")
        if str(e.get("request_id")) in ev.open_leases:
            out.append(f"{s.label}: reservation still open")
    return out


def deadline(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 5: all attempts together within the effective deadline: a JSON answer's whole
    duration, a stream's first byte (or its error, when none came); the client saw no more either."""
    out = []
    for s in ev.sent:
        e = _entry(ev, s)
        if e is None or s.cancelled:
            continue
        bound = s.deadline_ms + DEADLINE_SLACK_MS
        first = e.get("first_byte_ms")
        took = e.get("duration_ms")
        measured = first if s.stream and s.chunks else took
        if measured is not None and measured > bound:
            out.append(f"{s.label}: {measured:.0f} ms past a {s.deadline_ms} ms deadline")
        client_ms = ((s.first_chunk_at - s.started) * 1000 if s.stream and s.first_chunk_at
                     else s.elapsed_s * 1000 if not s.chunks else 0.0)
        if client_ms > bound:
            out.append(f"{s.label}: the client waited {client_ms:.0f} ms on a {s.deadline_ms} ms deadline")
    return out


def retries(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 6: at most 1 + the route's retries upstream arrivals, none after a 400/401/403, and a
    request with effects never sent twice after it may have been acted on (one arrival that answered
    no error, or none, ends it)."""
    out = []
    for s in ev.sent:
        route = snap.routes.get(s.route)
        got = ev.arrivals.get(_rid(ev, s), [])
        if route is None or not got:
            continue
        if len(got) > 1 + route.retry.attempts:
            out.append(f"{s.label}: {len(got)} arrivals, the route allows {1 + route.retry.attempts}")
        for a in got[:-1]:
            if a.status in NEVER_RETRIED:
                out.append(f"{s.label}: retried after {a.status}")
        e = _entry(ev, s) or {}
        if e.get("effects") and any(a.status < 400 for a in got[:-1]):
            out.append(f"{s.label}: a request with effects was sent again after an attempt that may have acted")
    return out


def fallback(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 7: nothing reached any upstream after the client's first byte, a failure after it was
    visible to the client and recorded, and every upstream reached was a candidate of the route for the
    request's data class."""
    out = []
    for s in ev.sent:
        route, e = snap.routes.get(s.route), _entry(ev, s)
        got = ev.arrivals.get(_rid(ev, s), [])
        if s.first_chunk_at is not None and any(a.at > s.first_chunk_at for a in got):
            out.append(f"{s.label}: an upstream was reached after the client's first byte")
        if s.chunks and not s.finished and not s.cancelled:
            if not s.visible_failure:
                out.append(f"{s.label}: the stream failed after its first byte without telling the client")
            if e is not None and e.get("termination") not in ("stream_interrupted", "deadline", "client_cancel"):
                out.append(f"{s.label}: recorded as {e.get('termination')!r}, not interrupted")
        if route is None or e is None:
            continue
        allowed = {c.deployment_name for c in route.candidates if e.get("data_class") in c.data_classes}
        for a in got:
            if a.deployment not in allowed:
                out.append(f"{s.label}: reached {a.deployment}, not a candidate for {e.get('data_class')}")
    return out


def one_record(snap: Snapshot, ev: Evidence) -> list[str]:
    """Invariant 8: exactly one ledger entry per request, naming the request id the client was given;
    a request no worker took has none and reached no upstream."""
    out = []
    for s in ev.sent:
        found = ev.entries.get(s.trace_id) or []
        if s.unprocessed and not found:
            if ev.arrivals.get(s.request_id):
                out.append(f"{s.label}: not processed by the gateway, yet reached an upstream")
            continue
        if len(found) != 1:
            out.append(f"{s.label}: {len(found)} ledger entries")
        elif s.request_id and found[0].get("request_id") != s.request_id:
            out.append(f"{s.label}: ledger names {found[0].get('request_id')}, the client got {s.request_id}")
    return out


CHECKS: Mapping[str, Check] = dict(zip(INVARIANTS, (budget, settled_once, deadline, retries, fallback, one_record),
                                       strict=True))


def check_all(snap: Snapshot, ev: Evidence) -> dict[str, list[str]]:
    """Invariant -> its violations (empty: held)."""
    return {name: check(snap, ev) for name, check in CHECKS.items()}


def by_trace(entries: Sequence[dict[str, Any]], traces: set[str]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e.get("trace_id") in traces:
            out.setdefault(str(e["trace_id"]), []).append(e)
    return out
