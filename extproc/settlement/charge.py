"""Accounting as pure functions (no I/O, no Envoy types): what a settlement charges and how the
ledger names the ending. Settlement first decodes what it saw of an exchange's end - Envoy's
access-log entry, or a response filter's own view of an answer - into one Ending value (the facts),
then charge_ending decides the charge from that value alone. tests/unit/test_accounting.py tables
them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from extproc.config import Snapshot
from extproc.config.plans import decode_plan
from extproc.config.schema import Deployment, Prices
from extproc.contract import ErrorCode
from extproc.shapes.base import is_count

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


# Every token of a usage object is in exactly one class, each priced at its own rate (Prices.per_mtok).
TOKEN_CLASSES = ("input", "cached_input", "cache_write", "cache_write_1h", "output", "reasoning")


def _count(doc: Any, name: str) -> int:
    v = doc.get(name) if isinstance(doc, dict) else None
    return int(v) if v is not None and is_count(v) else 0


def token_classes(usage: Usage) -> dict[str, int]:
    """A usage object's tokens by class (the internal shape, extproc/lua/answers.lua `usage_json`):
    `prompt_tokens` holds the cache's reads (`cached_tokens`) and writes (`cache_write_tokens`,
    `cache_write_1h_tokens`) and the rest is `input`; `completion_tokens` holds `reasoning_tokens`
    and the rest is `output`. A part larger than its whole is cut to what is left of it: the classes
    always sum to the prompt and completion tokens."""
    prompt, completion = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    details, out_details = usage.get("prompt_tokens_details"), usage.get("completion_tokens_details")
    cached = min(prompt, _count(details, "cached_tokens"))
    write = min(prompt - cached, _count(details, "cache_write_tokens"))
    write_1h = min(prompt - cached - write, _count(details, "cache_write_1h_tokens"))
    reasoning = min(completion, _count(out_details, "reasoning_tokens"))
    return {"input": prompt - cached - write - write_1h, "cached_input": cached, "cache_write": write,
            "cache_write_1h": write_1h, "output": completion - reasoning, "reasoning": reasoning}


def charge_lines(usage: Usage, prices: Prices) -> list[dict[str, Any]]:
    """The priced lines of a usage (the classes it has): tokens and the rate, as the ledger records them."""
    return [{"class": c, "tokens": n, "per_mtok": prices.per_mtok(c)} for c, n in token_classes(usage).items() if n]


def charge_of(usage: Usage, prices: Prices) -> tuple[int, int]:
    """(micro-units, tokens) for a usage object: each class at its rate, rounded up once to a micro-unit."""
    classes = token_classes(usage)
    micros = math.ceil(sum(n * prices.per_mtok(c) for c, n in classes.items()) / 1e6)
    return micros, sum(classes.values())


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
    details, out_details = usage.get("prompt_tokens_details") or {}, usage.get("completion_tokens_details") or {}
    counts = [usage.get("prompt_tokens"), usage.get("completion_tokens"),
              *(details.get(k) for k in ("cached_tokens", "cache_write_tokens", "cache_write_1h_tokens")
                if isinstance(details, dict)),
              out_details.get("reasoning_tokens") if isinstance(out_details, dict) else None]
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
        # (An answer the checks refused was generated whole: its reported usage is the actual charge.)
        whole = termination in ("complete", ErrorCode.ANSWER_REJECTED.value)
        return micros, tokens, "actual" if whole and source == "reported" else "partial"
    if 200 <= status < 300 or failed == "ambiguous":
        return -1, -1, "ambiguous"
    return 0, 0, failed


@dataclass(frozen=True)
class Ending:
    """How one admitted exchange ended, decoded before anything is decided: the facts a charge is
    decided from, and nothing else. Two places see an ending and both decode into this one record:
    Envoy's access-log entry (extproc/settlement/access_log.py `ending_of`) and the response filter that
    holds an answer itself - an idempotent or checked answer, an idempotent stream
    (extproc/settlement/meter.py)."""

    status: int  # the status the client got (before the checks' refusal, `rejected`)
    stream: bool
    prompt_bound: int  # the reservation's bound on the prompt's tokens
    usage: Usage | None = None  # the answer's usage, as a filter read it
    chunks: int = 0  # the stream guard's count of what was generated
    stream_done: bool = False  # the stream guard passed the stream's normal end on
    whole: bool = True  # the answer's end reached the filter (False: Envoy ended the exchange before it)
    client_closed: bool = False  # the client's connection ended (Envoy's DC flag)
    upstream_timeout: bool = False  # Envoy's per-request timeout (its UT flag)
    backstop: bool = False  # its own filter should have settled it and did not: what the client got is unknown
    broken: bool = False  # a filter found a 2xx it could not read or carry and answered 502
    rejected: bool = False  # the answer checks refused a whole answer: the client got the contract's 502
    sent: bool = False  # an upstream got the request
    answered: bool = False  # an upstream sent response headers
    upstream_status: str = ""  # the upstream's own status, as the Lua filter nearest the router recorded it
    degraded_response: bool = False  # Envoy's degraded answer for a route whose upstreams were all down
    count: bool = False  # a door's token count: nothing generated, nothing charged


@dataclass(frozen=True)
class Charge:
    """What a settlement charges and records, decided from an Ending (charge_ending)."""

    termination: str
    usage: Usage | None
    source: str  # reported, estimated, unbelievable or none
    micros: int  # -1: the whole reservation
    tokens: int
    kind: str  # actual, partial, ambiguous or released
    status: int  # the status the ledger records: the client's (the checks' 502 for a refused answer)
    degraded: bool = False  # served by Envoy's degraded answer: the ledger marks it


def charge_ending(x: Ending, dep: Deployment | None) -> Charge:
    """The charge for an exchange as it ended: reported usage when a filter read one (the backstop
    believes none), else the stream guard's chunk count for a 2xx stream, else what a failure may have
    cost (failure_charge); the termination from how it ended. The one charge rule: every settlement
    that follows an answer comes through here."""
    usage = None if x.backstop else x.usage
    source = "reported" if usage else "none"
    if usage is None and x.stream and x.chunks and 200 <= x.status < 300 and not x.backstop:
        usage, source = estimated(x.prompt_bound, x.chunks), "estimated"
    if x.client_closed and not (x.stream and x.stream_done):
        # (A client that closes right after the last chunk got the whole stream: not a cancel.)
        termination = "client_cancel"
    elif (x.upstream_timeout or x.status == 504) and not x.stream:
        termination = "deadline"
    elif x.backstop:
        termination = "unknown"
    else:
        # A stream is complete only when its guard saw its normal end; a stream it did not guard
        # reaches here only when Envoy cut it after it started (or it failed before).
        termination = termination_of(x.status, (x.stream_done if x.stream else True) and x.whole)
    status = x.status
    if x.rejected:
        # The upstream did the work; the client got the contract's 502 (or the stream's end) instead.
        termination, status = ("upstream_error" if x.broken else ErrorCode.ANSWER_REJECTED.value), 502
    failed = "ambiguous" if x.broken else "released"  # a broken 2xx: the work was done
    if usage is None and not 200 <= x.status < 300 and not x.broken:
        usage, failed = failure_charge(stream=x.stream, sent=x.sent, answered=x.answered,
                                       prompt_bound=x.prompt_bound,
                                       succeeded=upstream_succeeded(x.upstream_status, x.answered))
        source = "estimated" if usage else source
    usage, source = believed(usage, source)
    if x.count:
        # Counted, not generated: no usage (the ledger's readers - exports, reconciliation, metrics - sum
        # usage as tokens processed, and no provider bills a count); its reservation of zero released.
        return Charge(termination, None, "none", 0, 0, "released", status)
    micros, tokens, kind = charge_for(usage, source, termination, status, dep, failed)
    if x.degraded_response and not x.answered:
        # Envoy's degraded answer (llmgw/render/errors.py): no upstream answered, nothing was generated.
        return Charge("degraded", None, "none", 0, 0, "released", status, degraded=True)
    return Charge(termination, usage, source, micros, tokens, kind, status)


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt that did not answer 2xx ended, as Envoy's attempt log reported it
    (extproc/settlement/attempt_log.py)."""

    n: int  # its number among the request's attempts
    status: int  # its upstream's status; 0: no response headers came
    sent: bool  # a byte of the request reached the upstream (not a connection that failed or never came)
    flags: tuple[str, ...] = ()  # Envoy's response flags of it (UT, UR, UF ...)


def earlier_charges(count: int, ends: dict[int, AttemptEnd], unanswered: tuple[int, int] | None
                    ) -> tuple[list[dict[str, Any]], int, int]:
    """The attempts before the answering one (1 to count - 1): each one's ledger facts and charge, and
    the total (micros, tokens). An attempt answered with an error status, or never sent, ran nothing
    and is charged nothing. One sent and never answered (a reset, no first byte within its limit) may
    have run to completion and reported nothing: charged `unanswered`, its bound as the reservation
    holds it (extproc/stages/budget.py), as `unknown`. `unanswered` is None when no retry may follow
    such an attempt (the route's policy), so none of these ran. An attempt the log did not report
    (its entry lost, or settled by a response filter that never sees the log) is charged as one that
    may have run: the charge errs toward its bound, never past it."""
    lines: list[dict[str, Any]] = []
    micros = tokens = 0
    for n in range(1, count):
        end = ends.get(n)
        ran = unanswered is not None and (end is None or (end.sent and end.status == 0))
        line: dict[str, Any] = {"n": n, "status": end.status if end else 0}
        if end is not None and end.flags:
            line["flags"] = list(end.flags)
        if ran and unanswered is not None:
            line.update(settlement="unknown", charged_micros=unanswered[0], charged_tokens=unanswered[1],
                        logged=end is not None)
            micros, tokens = micros + unanswered[0], tokens + unanswered[1]
        else:
            line.update(settlement="released", charged_micros=0, charged_tokens=0)
        lines.append(line)
    return lines, micros, tokens


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclass(frozen=True)
class Timing:
    """When an answer reached its client, in seconds from the request's arrival at Envoy (None when not
    known). A stream's time to first token is its first content's (the stream guard's stamp), not its
    headers': an engine sends those, and an empty role chunk, before it queues and prefills."""

    duration_s: float | None = None  # to the answer's last byte
    first_byte_s: float | None = None  # to its first byte: the headers (time to headers)
    first_token_s: float | None = None  # a stream's first content token (TTFT); None for a JSON answer

    @property
    def ledger(self) -> dict[str, float | None]:
        return {"duration_ms": _ms(self.duration_s), "first_byte_ms": _ms(self.first_byte_s),
                "first_token_ms": _ms(self.first_token_s)}


def outcome_of(termination: str, status: int, kind: str, usage: Usage | None, source: str,
               dep: Deployment | None, redactions: str, attempt: dict[str, Any],
               timing: Timing = Timing(), marks: dict[str, str] | None = None) -> dict[str, Any]:
    """The settlement half of a ledger entry (the admission half is stored with the reservation).
    `timing` runs from the request's arrival to its answer's first byte, first token and last byte
    to the client; `llmgw report` and the objectives read their latencies from it. Usage that was
    charged is also recorded as its priced lines (charge_lines): one per token class."""
    return {"termination": termination, "status": status, "settlement": kind, "usage": usage,
            **({"charge_lines": charge_lines(usage, dep.prices)} if usage and dep is not None else {}),
            **{k: v for k, v in (marks or {}).items() if v},  # degraded, canary: what served it, and why
            **timing.ledger,
            "usage_source": source, "price_version": dep.prices.version if dep else "", "redactions": redactions,
            "attempts": [{"deployment": dep.deployment if dep else "",
                          "adapter": dep.fingerprint.adapter if dep else "", "status": status, **attempt}]}
