"""The decision filter: one ext_proc message decides a request. Envoy sends the buffered body (or, for
the model list, the headers) with the CEL attributes ext_proc needs; the stages (extproc/pipeline.py)
decide under one revision, and the reply admits the request, answers it (a replay, the route's
degraded answer, the model list) or refuses it in the contract's shape. A refusal releases what it
reserved, or is ledgered, after the reply."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc import tracing
from extproc.admission import AdmissionControl
from extproc.clocks import envoy_stamp
from extproc.config.reload import Live
from extproc.contract import ErrorCode, GatewayError
from extproc.decisions import DecisionRecorder
from extproc.envoy_msgs import header_text
from extproc.exchange import Exchange
from extproc.jwks import JwksCache
from extproc.metrics import count_refusal
from extproc.names import REQUEST_HEADER, Filter, Header
from extproc.picker import Picker
from extproc.pipeline import build_stages, run_stages
from extproc.ratelimit import RateLimitedLog
from extproc.replies import admit, degraded_answer, immediate, longer_wait, refuse
from extproc.service.models import answer_models
from extproc.settlement.releases import DEGRADED_RELEASE, record_refusal, refusal, release
from extproc.shapes.registry import door_for
from extproc.slices import SliceBook
from extproc.stages.budget import Replay
from extproc.stages.identity import CallerIdentity
from extproc.stages.route import Degraded
from extproc.store import Store

log = logging.getLogger("llmgw.extproc")
_internal_errors = RateLimitedLog(log, every_s=10.0)
GAVE_UP_MARGIN_S = 0.05  # a decision this close to Envoy's message timeout is taken to be too late


def apply_attributes(ex: Exchange, attrs: struct_pb2.Struct) -> None:
    """Copy the CEL attributes Envoy sent; a header the request lacks is simply absent."""
    for key, value in attrs.fields.items():
        if value.WhichOneof("kind") != "string_value":
            continue
        s = value.string_value
        if key.startswith(REQUEST_HEADER):
            ex.headers[key[len(REQUEST_HEADER):-2]] = s
        elif key == "request.id":
            ex.request_id = s
        elif key == "request.path":
            ex.path = s
        elif key == "request.method":
            ex.method = s
        elif key == "request.time":
            # Unparsable or off ext_proc's clock: keep its own, and the deadline counts from a little later.
            at = envoy_stamp(s, time.time())
            if at is not None:
                ex.arrived_at = at


def apply_headers(ex: Exchange, headers: base_pb2.HeaderMap) -> None:
    for h in headers.headers:
        value = header_text(h)
        if h.key == ":path":
            ex.path = value
        elif h.key == ":method":
            ex.method = value
        elif h.key[0] != ":":
            ex.headers[h.key] = value
    ex.request_id = ex.headers.get("x-request-id", ex.request_id)


def too_late() -> GatewayError:
    """What the caller of a decision that came after Envoy's message timeout got: Envoy's own 503."""
    return GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the decision came after Envoy stopped waiting")


class DecisionFilter:
    """The decision filter's streams, each decided by the stages under the revision live when it came."""

    def __init__(self, live: Callable[[], Live], picker: Picker | None, jwks: JwksCache, store: Store | None,
                 decisions: DecisionRecorder, admission: AdmissionControl | None, slices: SliceBook | None = None):
        self._live = live
        self.store = store
        self.stages = build_stages(picker, jwks, store, decisions, admission, slices)
        self._identity = CallerIdentity(jwks)
        self._background: set[asyncio.Task[None]] = set()

    def _later(self, coro: Any) -> None:
        """Ledger writes for refusals: after the reply, so a refusal is never slower for them."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def decide(self, first: ep.ProcessingRequest,
                     _rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncGenerator[ep.ProcessingResponse, None]:
        """The decision filter. One message decides: Envoy sends the buffered body (or, for the model
        list, the headers) and nothing after it. The stream is closed as soon as the decision is sent,
        so an admitted request no longer depends on this worker: Envoy ignores a processor that closed
        cleanly (only a gRPC error ends the request), and the worker may restart while it runs."""
        live = self._live()
        # The whole request is decided under this one revision, whatever a reload does meanwhile.
        ex = Exchange(snapshot=live.snapshot, cache_salts=live.cache_salts, sealer=live.sealer,
                      shadow_key=live.shadow_key, region=live.region, credentials=live.credentials,
                      credential_errors=live.credential_errors)
        attrs = first.attributes.get(Filter.EXT_PROC) if first.attributes else None
        if attrs is not None:
            apply_attributes(ex, attrs)
        kind = first.WhichOneof("request")
        timeout_s = ex.snapshot.gateway.envoy.extproc_message_timeout_ms / 1000
        envoy_waits_until = ex.received_at + timeout_s  # then Envoy answers 503 itself and closes the stream

        def gave_up() -> bool:
            """Envoy has stopped waiting: whatever this decision says, the caller got Envoy's own 503."""
            return time.monotonic() >= envoy_waits_until - GAVE_UP_MARGIN_S
        try:
            match kind:
                case "request_body":
                    ex.raw_body = first.request_body.body
                    door = door_for(ex.path)  # once: identity and intake both need it
                    ex.door = door.name if door is not None else ""
                    resume = await run_stages(self.stages, ex)
                    while resume is not None:  # admission queued it: Envoy is told to wait, then it waits
                        waiting, ex.waiting = ex.waiting, None
                        try:
                            yield longer_wait(waiting.wait_s + timeout_s)
                        except GeneratorExit:  # the stream closed while the reply was on its way
                            waiting.abandon()
                            self._release_undecided(ex, gave_up=False)
                            raise
                        envoy_waits_until = time.monotonic() + waiting.wait_s + timeout_s
                        await waiting.wait()
                        resume = await run_stages(self.stages, ex, resume)
                    yield admit(ex)
                case "request_headers":
                    apply_headers(ex, first.request_headers.headers)
                    yield await answer_models(ex, self._identity)
                case _:
                    _internal_errors.warning("unexpected first ext_proc message %s", kind)
        except Replay as replay:  # Idempotency-Key seen and completed: its recorded outcome
            # Scheduled before the reply: Envoy may close the stream once it has it, and code after
            # the last yield would then never run.
            answer = replay.answer
            self._later(record_refusal(self.store, ex, "idempotent_replay", answer.status, ""))
            yield immediate(ex, answer.status, answer.body, "llmgw_idempotent_replay",
                            {Header.IDEMPOTENT_REPLAY: "true"}, content_type=answer.content_type)
        except Degraded as degraded:  # no candidate qualified: the route's fixed answer, nothing spent
            ex.degraded = "response"
            if gave_up():
                self._ended(ex, too_late(), gave_up=True)
            else:
                self._later(release(self.store, ex, DEGRADED_RELEASE[0], 200, DEGRADED_RELEASE[1])
                            if ex.held is not None else record_refusal(self.store, ex, "degraded", 200, ""))
            yield degraded_answer(ex, degraded.text)
        except GatewayError as err:
            self._ended(ex, err, gave_up())
            yield refuse(ex, err)
        except asyncio.CancelledError:
            self._release_undecided(ex, gave_up=gave_up())
            raise
        except Exception:  # never crash on input: fail closed with the contract's error
            _internal_errors.error("request %s: internal error", ex.request_id, exc_info=True)
            failure = GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the gateway could not evaluate this request")
            self._ended(ex, failure, gave_up())
            yield refuse(ex, failure)

    def _release_undecided(self, ex: Exchange, gave_up: bool) -> None:
        """Envoy closed the stream before the decision: it stopped waiting (`gave_up`: its 503, which the
        access log also releases), or the client went away (which nothing else would release before the
        lease expired and charged it in full). Released now either way, named as the access log would."""
        if ex.held is not None:
            termination, status = ("not_processed", 503) if gave_up else ("cancelled", 499)
            self._later(release(self.store, ex, termination, status))

    def _ended(self, ex: Exchange, err: GatewayError, gave_up: bool) -> None:
        """A refused request: release what it reserved, or record the refusal in the ledger. A refusal
        decided after Envoy stopped waiting never reached the caller, who got Envoy's 503: its ledger
        entry says that (`not_processed`), as the access log's release of it does, so whichever of the
        two settles first the ledger says one thing."""
        if gave_up:
            err = too_late()
        termination, marks = ("not_processed", {}) if gave_up else refusal(err.code.value, err.param)
        route = ex.route_asked()
        count_refusal(route, err.code.value)
        if ex.trace_id and ex.identity is not None:  # a request the ledger records: its span too
            tracing.request_span(ex.trace_context, route, ex.arrived_at, time.time(), {
                **tracing.request_facts(route, ex.request_id, err.status, termination, ex.operation),
                "error.type": err.code.value})
        if ex.held is not None:
            self._later(release(self.store, ex, termination, err.status, marks))
        elif ex.identity is not None:  # a store that is down takes it when it is back (record_refusal)
            self._later(record_refusal(self.store, ex, termination, err.status, err.code.value, err.param))
