"""Settlement by the response filters that hold an answer themselves: idempotent and checked JSON
answers (the meter role), and streams the ext_proc stream guard guards (extproc/service/streams.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

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
from extproc.envoy_msgs import attr, md_attr, with_first
from extproc.names import ATTEMPT_COUNT, LEDGER_MARKS, Filter, Header, Key
from extproc.redact import log_safe, plain_id
from extproc.replay import Answer, Sealer
from extproc.replies import overwrite_header, refuse_answer
from extproc.settlement.charge import (
    Ending,
    Timing,
    Usage,
    answered_by,
    charge_ending,
    earlier_charges,
    first_byte_ms,
    outcome_of,
)
from extproc.settlement.observe import REASON_LIMIT, SettledRequest, observer
from extproc.settlement.settler import Settler
from extproc.shapes.registry import DOORS_BY_NAME
from extproc.sse import StreamUsage
from extproc.store import Replayable, Settlement, unanswered_bound

MAX_JSON_BODY = 8 << 20



class Meter:
    """Settles answers the response filters saw: idempotent JSON answers (the meter role) and
    streams (for the stream guard, extproc/service/streams.py)."""

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
        # The attempts before this answer: a response filter never sees the attempt log, so one that may
        # have run is charged at its bound (earlier_charges).
        count = attr(attrs, ATTEMPT_COUNT)
        n = int(count) if count.isdigit() else 1
        earlier, earlier_micros, earlier_tokens = earlier_charges(n, {}, unanswered_bound(held))
        outcome["attempts"] = [*earlier, {**outcome["attempts"][-1], "n": n}]
        observe = observer(SettledRequest(
            dep, md_attr(attrs, Key.ROUTE), sse, status, outcome, rid, md_attr(attrs, Key.TRACE),
            md_attr(attrs, Key.REVISION), started, timing,
            tenant if snap.gateway.metrics.tenant_label else ""))
        return self.settler.submit(Settlement(tenant, rid, outcome, micros, tokens, replay, hint,
                                              earlier=(earlier_micros, earlier_tokens)), observe)


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
