"""Settlement: every reservation ends exactly once (invariant 4), with one ledger entry
(invariant 8), written by the same store script; the first settlement of a request wins.

- JSON answers: Envoy's gRPC access log (SettlementLog), usage copied into metadata by
  json_to_metadata.
- Streams: the access log too, usage (and how the stream ended, and the chunks generated so far)
  written into the metadata by the Lua stream guard in Envoy (extproc/lua/stream_guard.lua).
- Idempotent streams: ext_proc's stream guard (extproc/streams.py) settles through the Meter's
  settle_stream, after recording what the client received for replay.
- Idempotent JSON answers: the meter, a blocking ext_proc filter on the response body that records
  the answer for replay and settles before the answer's last chunk reaches the client, so a repeat
  of the key that follows the answer is replayed, never run again.
- Everything Envoy saw fail (an error status, a cut stream, a client gone) settles from the access
  log at once, whoever else would have settled it; for a stream or an idempotent answer that ended
  normally, the access log settles only as a backstop, if its filter never did (a worker died).
- What a failure is charged (`failure_charge`): nothing when the upstream never got the request or
  answered with an error status; for a request it got but never answered - or answered 2xx before
  Envoy failed the answer (too large to read, a body that stalled: `upstream_status`) - the prompt's
  bound when it was a stream (nothing was generated before the first byte) and the whole
  reservation, marked `ambiguous`, for a JSON answer (the engine may have generated it all). Either
  way settled at once, and the idempotency key is released so a retry can run.
- Not processed: Envoy's own 503 when no decision reached it (`_release_unprocessed`) releases what
  a worker reserved for the request at once.
- Release: a request refused after it reserved (a later stage failed) is released, charge 0.
- The sweeper: a reservation whose lease expired (the gateway lost track: crash, lost access log)
  is charged in full and marked `ambiguous`, so a crashed gateway never frees money it may have spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc import tracing
from extproc.accounting import (
    Ending,
    Timing,
    Usage,
    answered_by,
    charge_ending,
    first_byte_ms,
    outcome_of,
)
from extproc.answer_checks import (
    CheckSpec,
    Verdict,
    call_policy,
    check_completion,
    checks_run,
    finish_reasons,
    is_completion,
    summary,
)
from extproc.clocks import envoy_stamp
from extproc.config import Snapshot
from extproc.config.schema import Deployment
from extproc.contract import METADATA_NAMESPACE, ErrorCode
from extproc.envoy_msgs import attr, count_attr, md_attr, with_first
from extproc.exchange import Exchange
from extproc.metrics import observe_settlement, observe_tenant
from extproc.names import EXTPROC_FAILED, LEDGER_MARKS, Filter, Header, Key, Settle, StreamEnd
from extproc.ratelimit import RateLimitedLog
from extproc.redact import log_safe, plain_id
from extproc.replay import Answer, Sealer
from extproc.replies import DEGRADED_DETAILS, REPLY_PREFIX, overwrite_header, refuse_answer
from extproc.shapes.registry import DOORS_BY_NAME
from extproc.sse import StreamUsage
from extproc.store import Replayable, Settlement, Store, StoreUnavailable

log = logging.getLogger("llmgw.settlement")
_store_down = RateLimitedLog(log)  # per-request lines while the store is down: bounded
MAX_JSON_BODY = 8 << 20
BATCH_MAX = 128
BATCH_WAIT_S = 0.002
REASON_LIMIT = 600  # an upstream's reason in the ledger (Envoy's filter bounds it to 500 bytes; escaping grows it)
RETRY_EVERY_S, RETRY_FOR_S = 0.5, 60.0  # settlements the store could not take, sent again


def released(termination: str, status: int, admission: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settlement of a reserved request that ended before dispatch: nothing spent, no attempt; how
    admission let it through, or why it shed it (ledger_facts holds it for the rest)."""
    return {"termination": termination, "status": status, "settlement": "released", "usage": None,
            "attempts": [], **(extra or {}), **({"admission": admission} if admission else {})}


def refused_termination(code: str) -> str:
    """A refusal's termination in the ledger: `denied` by policy, `refused` for every other reason."""
    return "denied" if code == ErrorCode.FORBIDDEN.value else "refused"


DEGRADED_RELEASE = ("degraded", {"degraded": "response"})  # the route's degraded answer: released, marked


def refusal_marks(code: str, field: str | None) -> dict[str, Any]:
    """What a refusal's ledger entry says of it: the contract's code, and the field it names as the
    caller wrote it (an unsupported or invalid one), where it names one."""
    return {"error": code, **({"field": field} if field else {})}


def refusal(code: str, field: str | None) -> tuple[str, dict[str, Any]]:
    """A refusal's termination and its marks (refusal_marks)."""
    return refused_termination(code), refusal_marks(code, field)


def decided_release(details: str, field: str) -> tuple[str, dict[str, Any]]:
    """The termination (and marks) of the decision's own answer, from the details it gave Envoy and the
    field its metadata names."""
    if details == DEGRADED_DETAILS:
        return DEGRADED_RELEASE
    return refusal(details.removeprefix(REPLY_PREFIX), field)


async def release(store: Store | None, ex: Exchange, termination: str, status: int,
                  extra: dict[str, Any] | None = None) -> None:
    """A reserved request ended before dispatch: nothing was spent."""
    if store is None or ex.held is None or ex.identity is None:
        return
    outcome = released(termination, status, ex.admission, extra)
    try:
        await store.settle(Settlement(ex.identity.tenant, ex.request_id, outcome, 0, 0, hint=ex.held.hint))
    except StoreUnavailable:
        _store_down.error("request %s: reservation not released (store unavailable); the sweeper will settle it",
                          ex.request_id)


async def record_refusal(store: Store | None, ex: Exchange, termination: str, status: int, code: str,
                         field: str | None = None) -> None:
    """The ledger entry of an authenticated request that holds no reservation (denied, refused). A store
    that does not answer is tried again every RETRY_EVERY_S for RETRY_FOR_S, as settlements are; the
    append is once-only, so a retry after a lost reply adds nothing."""
    if store is None or ex.identity is None or ex.held is not None:
        return
    outcome = {"termination": termination, "status": status, **refusal_marks(code, field), "settlement": "none",
               "usage": None, "attempts": []}
    facts, tenant = ex.ledger_facts(), ex.identity.tenant
    give_up = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            # A reserve whose reply was lost may have run: its reservation is released at nothing and
            # its settlement is the request's one entry. Otherwise the refusal's entry, once; its marker
            # also refuses a reserve of this request that runs late.
            if ex.reserve_unknown and await store.settle(
                    Settlement(tenant, ex.request_id, {**outcome, "settlement": "released"}, 0, 0)) is not None:
                return
            await store.append_ledger(tenant, ex.request_id, facts, outcome)
            return
        except StoreUnavailable:
            if time.monotonic() >= give_up:
                _store_down.error("request %s: ledger entry lost (store unavailable for %.0f s)", ex.request_id,
                                  RETRY_FOR_S)
                return
            await asyncio.sleep(RETRY_EVERY_S)


class Settler:
    """Settlements queued by the filters and the access log, sent in one store round trip for every
    batch gathered within BATCH_WAIT_S (each is still its own atomic script). `submit` returns a
    future that says whether its batch was written, for the callers that must wait for it. A batch
    the store could not take is sent again every RETRY_EVERY_S for RETRY_FOR_S, so a store that comes
    back settles to actual usage (settling twice is harmless: the first wins); after that the lease
    expires and the sweeper charges in full."""

    def __init__(self, store: Store):
        self.store = store
        # (settlement, its future, when it first failed: 0.0 = never, what to observe once it is written)
        self._queue: list[tuple[Settlement, asyncio.Future[bool], float, Observe | None]] = []
        self._flushing: asyncio.Task[None] | None = None

    def submit(self, item: Settlement, observe: Observe | None = None) -> asyncio.Future[bool]:
        """`observe` runs once if this settlement is the one the store keeps (the metrics)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((item, done, 0.0, observe))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        return done

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                if len(self._queue) < BATCH_MAX:
                    await asyncio.sleep(BATCH_WAIT_S)
                batch, self._queue = self._queue[:BATCH_MAX], self._queue[BATCH_MAX:]
                first: list[bool] = []
                try:
                    first = await self.store.settle_many([item for item, _, _, _ in batch])
                    written = True
                except StoreUnavailable:
                    written = False
                    now = loop.time()
                    kept = [(item, done, failed or now, observe) for item, done, failed, observe in batch
                            if now - (failed or now) < RETRY_FOR_S]
                    if len(kept) < len(batch):
                        log.error("%d settlement(s) not written for %.0fs (store unavailable); the sweeper "
                                  "will charge them when their leases expire", len(batch) - len(kept), RETRY_FOR_S)
                    self._queue = kept + self._queue
                except Exception:  # a settlement that cannot be written at all (a bug): never the whole queue
                    written = False
                    log.exception("%d settlement(s) could not be written; the sweeper will charge them when "
                                  "their leases expire", len(batch))
                for _, done, _, _ in batch:
                    if not done.done():
                        done.set_result(written)
                # Metrics and spans of the settlements the store kept; what they raise never holds up a
                # settlement (their callers are already answered).
                for (_, _, _, observe), won in zip(batch, first, strict=False):
                    if won and observe is not None:
                        try:
                            observe()
                        except Exception:
                            log.exception("observing a settlement failed")
                if not written and self._queue:
                    await asyncio.sleep(RETRY_EVERY_S)
        finally:
            self._flushing = None


class Meter:
    """Settles answers the response filters saw: idempotent JSON answers (the meter role) and
    streams (for the stream guard, extproc/streams.py)."""

    def __init__(self, settler: Settler, snapshot: Callable[[], Snapshot], sealer: Callable[[], Sealer]):
        self.settler = settler
        self.snapshot = snapshot
        self.sealer = sealer

    async def meter(self, first: ep.ProcessingRequest,
                    rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        """An idempotent JSON answer, chunk by chunk (Envoy waits for each reply): every chunk passes
        as it is; the last is held until the answer is recorded for replay and settled. A repeat of
        the key can then only come after the answer is replayable. If the store is down the answer
        still goes out (the lease settles it later).

        A checked answer (Settle.CHECKED) comes as its headers, then its whole body: the headers wait
        for the body's reply, which checks the answer (extproc/answer_checks.py), settles it, and then
        passes it, passes it naming what failed (`report`), or replaces it with the contract's 502
        `answer_rejected` in the caller's shape (`enforce`)."""
        first_at = time.time()  # the first message is the answer's first chunk (or its headers)
        attrs = first.attributes.get(Filter.EXT_PROC) if first.attributes else None
        tenant, rid, hint = md_attr(attrs, Key.TENANT), attr(attrs, "request.id"), md_attr(attrs, Key.HOLD)
        code = attr(attrs, "response.code")
        status = int(code) if code.isdigit() else 0
        spec_text = md_attr(attrs, Key.CHECKS)
        spec = CheckSpec.decode(spec_text) if spec_text else None
        body, settled = bytearray(), not (tenant and rid and hint)
        try:
            async for msg in with_first(first, rest):
                kind = msg.WhichOneof("request")
                if kind == "response_headers":  # a checked answer's: they wait for the body's reply
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                    if not msg.response_headers.end_of_stream:
                        continue
                elif kind != "response_body":
                    continue
                else:
                    chunk = msg.response_body.body
                    if len(body) + len(chunk) <= MAX_JSON_BODY:
                        body += chunk
                    if not msg.response_body.end_of_stream:
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                        continue
                if spec is not None:
                    spec = spec.answered_by(answering(self.snapshot(), attrs))
                verdict = self.check(spec, bytes(body)) if 200 <= status < 300 else None
                if not settled:
                    settled = True
                    done = self._settle(tenant, rid, hint, attrs, status, True, False, StreamUsage(), bytes(body),
                                        first_at, verdict)
                    # Waited for (a store batch) only when it must come first: an idempotent answer is
                    # recorded before the client can repeat it, and a refused one is settled before the
                    # access log sees its 502 (which it would settle at once, without the checks). A
                    # passed answer is its filter's to settle; the access log waits for it (BACKSTOP_S).
                    if orjson.loads(hint).get("i") or (verdict is not None and verdict.rejected):
                        await done
                if kind == "response_headers":
                    return
                yield self._checked_reply(verdict, attrs)
                return
        finally:  # Envoy ended the exchange early (reset, client gone): what was seen settles
            if not settled:
                self._settle(tenant, rid, hint, attrs, status, False, False, StreamUsage(), bytes(body), first_at)

    def check(self, spec: CheckSpec | None, body: bytes) -> Verdict:
        """A 2xx JSON answer's verdict: checked when the request asked for it (spec), else only read for
        the ledger. A checked one that is not a chat completion is the upstream's broken answer (502
        upstream_error, charged as the work it may have been)."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if not is_completion(doc):
            return Verdict(spec, (), broken=spec is not None)
        policy = call_policy(self.snapshot().policy) if spec is not None else None
        failures = check_completion(doc, spec, policy) if spec is not None else []
        # (Not the body's model: the Lua guard has named the route there; settlement takes the
        # upstream's from the metadata json_to_metadata wrote.)
        return Verdict(spec, tuple(failures), finish=finish_reasons(doc), upstream_id=str(doc.get("id") or ""),
                       run=checks_run(spec, policy))

    @staticmethod
    def _checked_reply(verdict: Verdict | None, attrs: Any) -> ep.ProcessingResponse:
        """The body's reply: as it is, with x-llmgw-answer-checks when a reported check failed, or the
        contract's 502 in the caller's shape."""
        if verdict is None or not (verdict.rejected or verdict.failures):
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        if not verdict.rejected:
            named = ep.HeaderMutation(set_headers=[overwrite_header(Header.ANSWER_CHECKS, summary(verdict.failures))])
            return ep.ProcessingResponse(response_body=ep.BodyResponse(
                response=ep.CommonResponse(header_mutation=named)))
        err = verdict.error()
        decision_id = md_attr(attrs, Key.DECISION_ID)
        body = err.body(decision_id)
        door = DOORS_BY_NAME.get(md_attr(attrs, Key.DOOR))
        if door is not None:
            body = door.error(err.status, body)
        return refuse_answer(err, body, decision_id, md_attr(attrs, Key.REVISION))

    def settle_stream(self, tenant: str, rid: str, hint: str, attrs: Any, status: int, complete: bool,
                      usage: StreamUsage, first_at: float, sent: bytes | None = None,
                      verdict: Verdict | None = None, token_at: float | None = None) -> asyncio.Future[bool]:
        """Settle a stream the stream guard saw (complete: it finished normally; first_at: when its
        first chunk reached the guard, token_at its first content; sent: what the client received,
        kept for replay when the request has an Idempotency-Key)."""
        return self._settle(tenant, rid, hint, attrs, status, complete, True, usage, sent or b"", first_at, verdict,
                            token_at)

    @staticmethod
    def ending(held: dict[str, Any], attrs: Any, status: int, complete: bool, sse: bool, stream_usage: StreamUsage,
               body: bytes, verdict: Verdict | None) -> Ending:
        """What this filter saw of the answer, as the one record a charge is decided from: the usage a
        2xx answer reported (a stream's usage chunk, a JSON answer's `usage`), the stream's count of
        what was generated and whether it ended normally, and what the answer checks found. The
        upstream did answer: its own status is the one the Lua filter nearest the router recorded."""
        usage: Usage | None = None
        if 200 <= status < 300 and sse:
            usage = stream_usage.usage
        elif 200 <= status < 300:
            with contextlib.suppress(ValueError):
                doc = orjson.loads(body)
                if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                    usage = doc["usage"]
        return Ending(status=status, stream=sse, prompt_bound=held.get("p", 0), usage=usage,
                      chunks=stream_usage.content_chunks, stream_done=stream_usage.done and not stream_usage.error,
                      whole=complete, broken=verdict is not None and verdict.broken,
                      rejected=verdict is not None and verdict.rejected, sent=True, answered=True,
                      upstream_status=md_attr(attrs, Key.UPSTREAM_STATUS))

    def _settle(self, tenant: str, rid: str, hint: str, attrs: Any, status: int, complete: bool, sse: bool,
                stream_usage: StreamUsage, body: bytes, first_at: float,
                verdict: Verdict | None = None, token_at: float | None = None) -> asyncio.Future[bool]:
        snap = self.snapshot()
        dep = answering(snap, attrs)
        held = orjson.loads(hint)
        c = charge_ending(self.ending(held, attrs, status, complete, sse, stream_usage, body, verdict), dep)
        termination, usage, source, micros, tokens, kind = c.termination, c.usage, c.source, c.micros, c.tokens, c.kind
        upstream_status, status = status, c.status
        replay = None
        if held.get("i") and termination == "complete":
            store = snap.gateway.store
            replay = Replayable(status, self.sealer().seal(
                held["i"], Answer(status, "text/event-stream" if sse else "application/json", body),
                store.idempotency_max_body_bytes), store.idempotency_ttl_s * 1000)
        started = envoy_stamp(attr(attrs, "request.time"), time.time())
        timing = Timing() if started is None else Timing(
            time.time() - started, first_at - started, None if token_at is None else token_at - started)
        outcome = outcome_of(termination, status, kind, usage, source, dep, md_attr(attrs, Key.REDACTIONS),
                             {"upstream": attr(attrs, "upstream.address"),
                              "first_byte_ms": first_byte_ms(started, first_at)},
                             timing, {k.value: md_attr(attrs, k) for k in LEDGER_MARKS})
        # The attempt's status is its upstream's own (Envoy or a check may have replaced it for the client).
        recorded = md_attr(attrs, Key.UPSTREAM_STATUS)
        outcome["attempts"][-1]["status"] = int(recorded) if recorded.isdigit() else upstream_status
        if verdict is not None:
            checked(outcome, verdict)
        # What Envoy's filters read of the answer as the upstream sent it: the model it named among them
        # (json_to_metadata, before the Lua guard named the route instead in the body this filter reads;
        # the engine check holds a hosted deployment to it).
        for key in (Key.NATIVE_FINISH_REASON, Key.UPSTREAM_REQUEST_ID, Key.UPSTREAM_MODEL):
            if value := md_attr(attrs, key):
                outcome["attempts"][-1][key.value] = plain_id(value)
        if lost := md_attr(attrs, Key.TRANSLATION_LOSS):  # translated by the decision: what it lost
            outcome["attempts"][-1]["translation_loss"] = lost.split(", ")
        if reason := md_attr(attrs, Key.UPSTREAM_MESSAGE):  # why the upstream refused it (no entity kept)
            outcome["attempts"][-1][Key.UPSTREAM_MESSAGE.value] = log_safe(reason, REASON_LIMIT)
        observe = observer(SettledRequest(
            dep, md_attr(attrs, Key.ROUTE), sse, status, outcome, rid, md_attr(attrs, Key.TRACE),
            md_attr(attrs, Key.REVISION), started, timing,
            tenant if snap.gateway.metrics.tenant_label else ""))
        return self.settler.submit(Settlement(tenant, rid, outcome, micros, tokens, replay, hint), observe)


def answering(snap: Snapshot, attrs: Any) -> Deployment | None:
    """The deployment whose answer a response filter reads (answered_by, from its attributes)."""
    return answered_by(snap, md_attr(attrs, Key.DEPLOYMENT), md_attr(attrs, Key.PLAN),
                       attr(attrs, f"response.headers['{Header.DEPLOYMENT}']"))


def checked(outcome: dict[str, Any], verdict: Verdict) -> None:
    """A checked answer's ledger facts: the checks and their outcome; on its attempt, each choice's
    finish reason and the upstream's own id for the answer."""
    if not verdict.broken and verdict.spec is not None:
        outcome["answer_checks"] = verdict.ledger()
    attempt = outcome["attempts"][-1]
    if verdict.finish:
        attempt["finish_reason"] = verdict.finish[0] if len(verdict.finish) == 1 else list(verdict.finish)
    if verdict.upstream_id:
        attempt["upstream_id"] = plain_id(verdict.upstream_id)
    if verdict.upstream_model:
        attempt["upstream_model"] = plain_id(verdict.upstream_model)


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


BACKSTOP_S = 2.0  # how long a stream's or idempotent answer's own filter has to settle it




class SettlementLog(als_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access log: one long-lived stream, entries in batches, each carrying the io.llmgw
    metadata (usage included, by json_to_metadata) and the exchange's fate. Every admitted request
    is logged here."""

    def __init__(self, settler: Settler, snapshot: Callable[[], Snapshot]):
        self.settler = settler
        self.snapshot = snapshot
        self.entries = 0  # received, for GET /status
        self._pending: set[asyncio.Task[None]] = set()

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for msg in request_iterator:
            self.entries += len(msg.http_logs.log_entry)
            for entry in msg.http_logs.log_entry:
                try:
                    self.settle_entry(entry)
                except Exception:  # one bad entry must not end the stream of all the others
                    _store_down.error("access log entry could not be settled", exc_info=True)
        return als_pb2.StreamAccessLogsResponse()

    def settle_entry(self, entry: Any) -> None:
        common = entry.common_properties
        md = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
        undecided = md is None or not attr(md, Key.SETTLE)
        if undecided and entry.response.response_code_details.startswith(EXTPROC_FAILED):
            self._later(self._release_unprocessed(entry.request.request_id))
            return
        if md is None:
            return
        tenant, hint, rid = attr(md, Key.TENANT), attr(md, Key.HOLD), entry.request.request_id
        if not tenant or not hint or not rid:
            return
        status = entry.response.response_code.value
        flags = common.response_flags
        # A client that hung up once its stream's guard had passed [DONE] got the whole stream.
        cut = any(getattr(flags, name) for name in _CUT_FIELDS
                  if not (name == "downstream_connection_termination" and passed_done(md)))
        if attr(md, Key.SETTLE) == Settle.DECIDED:
            # The decision answered it itself (a refusal, a degraded answer): the worker that decided it
            # releases it. This is the backstop for a worker that died first, and it writes the same
            # entry, so the ledger says one thing whichever settles it (the first settlement wins).
            asyncio.get_running_loop().call_later(BACKSTOP_S, self._release_decided, entry, md, tenant, hint, rid)
            return
        if attr(md, Key.SETTLE) in _OWN_FILTER_SETTLES and 200 <= status < 300 and not cut:
            # An idempotent answer or stream that ended normally: its ext_proc filter settles it. This
            # is the backstop for a filter that could not (its worker died); the first settlement wins.
            asyncio.get_running_loop().call_later(BACKSTOP_S, self._settle, entry, md, tenant, hint, rid, True)
            return
        self._settle(entry, md, tenant, hint, rid, False)

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release_unprocessed(self, rid: str) -> None:
        """Envoy answered 503 itself: its decision never arrived (the worker was too slow, or died after
        it reserved). No upstream saw the request, so what a worker reserved for it is released now,
        not charged in full when its lease expires; the ledger entry says `not_processed`. The access
        log knows only the request's id: every tenant's reserve of it is marked refused first
        (Store.mark_unprocessed), then its tenant is found by the reservation it holds, if it holds one -
        a reserve still on its way when Envoy gave up holds nothing. A store that does not answer is
        asked again every RETRY_EVERY_S for RETRY_FOR_S, as settlements are."""
        if not rid:
            return
        give_up = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                held = await self.settler.store.mark_unprocessed(rid, list(self.snapshot().gateway.tenants))
                break
            except StoreUnavailable:
                if time.monotonic() >= give_up:
                    _store_down.error("request %s: not released (store unavailable); its lease will expire", rid)
                    return
                await asyncio.sleep(RETRY_EVERY_S)
        if held is not None:
            tenant, hint = held
            self.settler.submit(Settlement(tenant, rid, released("not_processed", 503, ""), 0, 0, hint=hint))

    def _release_decided(self, entry: Any, md: Any, tenant: str, hint: str, rid: str) -> None:
        termination, extra = decided_release(entry.response.response_code_details, attr(md, Key.REFUSED_FIELD))
        outcome = released(termination, entry.response.response_code.value, attr(md, Key.ADMISSION), extra)
        self.settler.submit(Settlement(tenant, rid, outcome, 0, 0, hint=hint))

    def _settle(self, entry: Any, md: Any, tenant: str, hint: str, rid: str, backstop: bool) -> None:
        common = entry.common_properties
        snap = self.snapshot()
        dep = answered_by(snap, attr(md, Key.DEPLOYMENT), attr(md, Key.PLAN),
                          entry.response.response_headers.get(Header.DEPLOYMENT, ""))
        x = ending_of(entry, md, hint, backstop)
        c = charge_ending(x, dep)
        marks = {k.value: attr(md, k) for k in LEDGER_MARKS}
        if c.degraded:
            marks[Key.DEGRADED.value] = "response"
        upstream = common.upstream_remote_address.socket_address
        first_byte = common.time_to_first_upstream_rx_byte
        def seconds(name: str) -> float | None:
            return getattr(common, name).ToNanoseconds() / 1e9 if common.HasField(name) else None
        start = common.start_time.ToNanoseconds() / 1e9 if common.HasField("start_time") else None
        token_at = attr(md, Key.FIRST_TOKEN_AT_US)  # the stream guard's stamp of the first content
        timing = Timing(seconds("time_to_last_downstream_tx_byte"), seconds("time_to_first_downstream_tx_byte"),
                        max(int(token_at) / 1e6 - start, 0.0) if token_at.isdigit() and start is not None else None)
        outcome = outcome_of(c.termination, x.status, c.kind, c.usage, c.source, dep,
                             attr(md, Key.REDACTIONS), {
                                 "upstream": f"{upstream.address}:{upstream.port_value}" if upstream.address else "",
                                 "count": common.upstream_request_attempt_count,
                                 "first_byte_ms": round(first_byte.ToNanoseconds() / 1e6, 1) if x.answered else None,
                                 # the upstream's own status (Envoy may have replaced it for the client)
                                 **({"status": int(x.upstream_status)}
                                    if x.answered and x.upstream_status.isdigit() else {}),
                                 # what it said of its answer: its id for it, how a stream finished
                                 **{k.value: plain_id(v) for k in (Key.FINISH_REASON, Key.UPSTREAM_ID,
                                                                        Key.NATIVE_FINISH_REASON,
                                                                        Key.UPSTREAM_REQUEST_ID, Key.UPSTREAM_MODEL)
                                    if x.answered and (v := attr(md, k))},
                                 # translated by the decision (extproc/direct.py): what the translation lost
                                 **({"translation_loss": lost.split(", ")}
                                    if (lost := attr(md, Key.TRANSLATION_LOSS)) else {}),
                                 # why it refused the request (every entity redacted: the ledger keeps none)
                                 **({Key.UPSTREAM_MESSAGE.value: log_safe(reason, REASON_LIMIT)}
                                    if x.answered and (reason := attr(md, Key.UPSTREAM_MESSAGE)) else {})},
                             timing, marks)
        if x.count and x.usage:  # a token count: the number the caller got, beside (not as) usage
            outcome["counted_tokens"] = x.usage["prompt_tokens"]
        observe = observer(SettledRequest(
            dep, attr(md, Key.ROUTE), x.stream, x.status, outcome, rid, attr(md, Key.TRACE), attr(md, Key.REVISION),
            start, timing, tenant if snap.gateway.metrics.tenant_label else ""))
        self.settler.submit(Settlement(tenant, rid, outcome, c.micros, c.tokens, hint=hint), observe)


def logged_usage(md: Any, prompt: Any) -> Usage:
    """A usage object as Envoy's filters left it in the metadata, in the internal shape: a class the
    upstream did not report is absent (a cache write, reasoning), a count it did not give is 0."""
    def counted(key: Key) -> Any:
        v = count_attr(md, key)
        return 0 if v is None else v
    details = {"cached_tokens": counted(Key.USAGE_CACHED),
               **{name: v for key, name in ((Key.USAGE_CACHE_WRITE, "cache_write_tokens"),
                                           (Key.USAGE_CACHE_WRITE_1H, "cache_write_1h_tokens"))
                  if (v := count_attr(md, key)) is not None}}
    usage: Usage = {"prompt_tokens": prompt, "completion_tokens": counted(Key.USAGE_COMPLETION),
                    "prompt_tokens_details": details}
    if (reasoning := count_attr(md, Key.USAGE_REASONING)) is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def ending_of(entry: Any, md: Any, hint: str, backstop: bool) -> Ending:
    """An access-log entry decoded: the facts settlement decides the charge from (accounting.Ending)."""
    common = entry.common_properties
    flags = common.response_flags
    prompt = count_attr(md, Key.USAGE_PROMPT)  # present only when a filter found a usage object
    usage: Usage | None = None
    if prompt is not None:
        usage = logged_usage(md, prompt)
    chunks = attr(md, Key.STREAM_CHUNKS)
    return Ending(
        status=entry.response.response_code.value, stream=attr(md, Key.STREAM) == "1",
        prompt_bound=int(orjson.loads(hint).get("p", 0)), usage=usage, chunks=int(chunks) if chunks else 0,
        stream_done=passed_done(md), client_closed=flags.downstream_connection_termination,
        upstream_timeout=flags.upstream_request_timeout, backstop=backstop,
        broken=bool(attr(md, Key.ANSWER_BROKEN)), sent=common.HasField("time_to_first_upstream_tx_byte"),
        answered=common.HasField("time_to_first_upstream_rx_byte"), upstream_status=attr(md, Key.UPSTREAM_STATUS),
        degraded_response=entry.response.response_headers.get(Header.DEGRADED) == "response",
        count=bool(attr(md, Key.COUNT)))


def passed_done(md: Any) -> bool:
    """Whether the request's stream guard (Lua's or ext_proc's) passed the stream's normal end on."""
    return attr(md, Key.STREAM_END) == StreamEnd.DONE


# Settled by their own ext_proc filter, the access log being the backstop.
_OWN_FILTER_SETTLES = (Settle.METERED, Settle.KEPT_STREAM, Settle.CHECKED, Settle.CHECKED_STREAM)
# Envoy's response flags for an exchange that ended abnormally (UF, UC, UR, UPE, DC, DPE, UT, SI, UO,
# URX, UMSDR, UH, LR), as the access log's proto names them.
_CUT_FIELDS = ("upstream_connection_failure", "upstream_connection_termination", "upstream_remote_reset",
               "upstream_protocol_error",
               "downstream_connection_termination", "downstream_protocol_error", "upstream_request_timeout",
               "stream_idle_timeout", "upstream_overflow", "upstream_retry_limit_exceeded",
               "upstream_max_stream_duration_reached", "no_healthy_upstream", "local_reset")


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


class Sweeper:
    """Charges expired leases in full, marked ambiguous. Every worker sweeps; settlement is idempotent."""

    def __init__(self, store: Store, tenants: Callable[[], Iterable[str]], interval_s: float = 1.0):
        self.store, self.tenants, self.interval_s = store, tenants, interval_s

    async def sweep_once(self, now_ms: int | None = None) -> int:
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        settled = 0
        for tenant in self.tenants():
            for rid in await self.store.expired_leases(tenant, now_ms):
                held = await self.store.reservation(tenant, rid)
                if not held:
                    continue  # settled since the lease was read
                outcome: dict[str, Any] = {"termination": "unknown", "settlement": "ambiguous", "usage": None,
                                           "attempts": [], "note": "lease expired before settlement: charged in full"}
                if await self.store.settle(Settlement(tenant, rid, outcome, hint=held.get("hint", ""))) is not None:
                    settled += 1
                    log.warning("request %s (%s): lease expired; charged in full as ambiguous", rid, tenant)
                    swept(rid, orjson.loads(held.get("record") or "{}"), outcome)()
        return settled

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep_once()
            except StoreUnavailable:
                pass  # the next round tries again; nothing is lost, leases stay in the store
            except Exception:
                log.exception("sweeper round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
