"""The attempt filter: ext_proc as an upstream filter of a plan's composite cluster, one stream per
attempt (extproc/config/plans.py). Envoy's router owns the retries; this only addresses each one.

- Request headers: which candidate this attempt goes to - the plan ext_proc decided (the request's
  `plan` metadata: the tenant and the qualified candidates in order), the attempt number
  (`x-envoy-attempt-count`) and the cluster of the host Envoy chose (its metadata). A host that is no
  candidate of the plan is never sent to: 503 `no_qualified_route`, which Envoy does not retry. The
  candidate's credential (resolved when the revision loaded), if it has one, is its authorization;
  otherwise there is none.
- Request body: the candidate's served model (the body was written for the first candidate; when
  the candidate serves that same model, the headers reply switches the body message off).
- Response headers: `x-llmgw-deployment` names the candidate that answered; `x-llmgw-translation-loss`
  what its adapter changed or lost of the request.
- A candidate of another API shape (extproc/shapes/): the path, headers (its authority too) and body
  of its shape on the way up - signed with the body when its shape signs (Bedrock's SigV4). Its 2xx
  answer's headers name the shape and the served model (`x-llmgw-answer-shape`, `-model`), and Envoy's
  Lua answer filter (extproc/lua/answers.lua) translates the answer, JSON or stream, downstream of the
  router, before the meter and the settlement read it - as it does for a lone candidate. No answer
  body ever passes this filter: Envoy 1.40 crashes when an upstream ext_proc filter's side stream
  crosses its buffer watermark while the upstream request ends (docs/ARCHITECTURE.md, "No answer body
  through the attempt filter"). Error statuses are left to Envoy's custom_response, which answers in
  the contract's shape.
- Each attempt is recorded in the store with its reservation, once: with its status when its response
  headers come, with status 0 when it ends without them; so the one ledger entry settlement writes
  lists every attempt, whichever ext_proc worker saw it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc import tracing
from extproc.config import Snapshot
from extproc.config.plans import attempt_kind, decode_plan, translated
from extproc.config.reload import Live
from extproc.config.schema import Deployment
from extproc.contract import CHAT_PATH, RETRY_AFTER_HEADER, ErrorCode, GatewayError
from extproc.envoy_msgs import attr, header, md_attr, with_first
from extproc.metrics import count_admission, count_attempt
from extproc.names import (
    ATTEMPT_COUNT_HEADER,
    ATTEMPT_WITHOUT_BODY,
    HOST_CLUSTER,
    UPSTREAM_REQUEST_ID_HEADERS,
    Filter,
    Header,
    Key,
)
from extproc.provider_quota import take_provider_quota
from extproc.ratelimit import RateLimitedLog
from extproc.redact import plain_id
from extproc.replies import overwrite_header, refuse_attempt
from extproc.shapes.base import Adapter, Target
from extproc.shapes.loss import cache_hinted, without_cache_hints
from extproc.shapes.registry import REQUEST_HEADERS, adapter_for
from extproc.store import Store, StoreUnavailable, quota_key

log = logging.getLogger("llmgw.attempts")
_errors = RateLimitedLog(log)
_PM = processing_mode_pb2.ProcessingMode


def choose_candidate(snap: Snapshot, plan: list[str], attempt: int, host_cluster: str) -> int:
    """The plan's index of the candidate this attempt goes to. The composite cluster sends attempt n to
    candidate n (attempts beyond the last candidate to the last), or - when that one has no healthy
    host - to the next that has one: the first candidate from there on whose cluster is the host's."""
    for i in range(min(max(attempt, 1), len(plan)) - 1, len(plan)):
        dep = snap.deployments.get(plan[i])
        if dep is not None and snap.pool_of(dep) == host_cluster:
            return i
    raise GatewayError(ErrorCode.NO_QUALIFIED_ROUTE,
                       f"attempt {attempt} reached {host_cluster or 'an unknown host'}, which is no candidate "
                       "this request qualified for")


def body_for(body: bytes, dep: Deployment) -> bytes | None:
    """The request body addressed to this candidate (of the contract's own shape, which caches prompts
    on its own: without caching breakpoints); None when it already is."""
    doc = json.loads(body)
    hinted = cache_hinted(doc)
    if doc.get("model") == dep.served_model and not hinted:
        return None
    if hinted:
        doc = without_cache_hints(doc)
    doc["model"] = dep.served_model
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


class AttemptFilter:
    def __init__(self, store: Store | None, live: Callable[[], Live]):
        self.store = store
        self.live = live
        self._pending: set[asyncio.Task[None]] = set()

    def _record_later(self, state: _Attempt) -> None:
        """Record the attempt once, without holding it up: the write is queued on the store's one
        pipelined connection at once, so it reaches the store well before the settlement, which
        waits for the end of the answer and the access log's flush."""
        state.recorded = True
        if state.record:
            count_attempt(str(state.record.get("deployment", "")), str(state.record.get("kind", "")), state.status)
        if state.dep is not None and state.trace:
            dep = state.dep
            tracing.attempt_span(state.trace, dep.served_model, state.started_at, time.time(), {
                "gen_ai.operation.name": dep.serves, "gen_ai.provider.name": dep.provider,
                "gen_ai.request.model": dep.served_model, "llmgw.deployment": dep.deployment,
                "llmgw.attempt.n": state.n, "llmgw.attempt.kind": state.record.get("kind"),
                "http.response.status_code": state.status or None, "llmgw.ledger.request_id": state.rid})
        self._store(state)

    def _store(self, state: _Attempt) -> None:
        """Queue the attempt's record as it stands on the store's one pipelined connection."""
        if self.store is not None and state.tenant and state.rid and state.record:
            task = asyncio.ensure_future(self._record(self.store, state.tenant, state.rid, state.n,
                                                      dict(state.record), state.hint))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _provider_quota(self, state: _Attempt) -> GatewayError | None:
        """A fallback attempt to a hosted candidate whose provider quota the decision did not reserve
        (it reserved the first candidate's it admitted to: the hint's `q`) takes from that quota before
        it is sent - the candidate's and the tenant's share, the request's token bound - so no retry
        or fallback exceeds a quota agreed with a provider (invariant 18). A spent quota refuses the
        attempt: 429 `overloaded` with retry-after, as admission refuses. The tokens stay taken at
        their bound (settlement gives back only what the decision reserved): a fallback errs toward
        the quota, never past it."""
        dep, store = state.dep, self.store
        if dep is None or dep.provider_quota is None or store is None or not state.hint:
            return None
        held = json.loads(state.hint)
        if any(str(key).startswith(quota_key(dep.deployment, "")) for key, *_ in held.get("q", ())):
            return None  # admission reserved this candidate's quota for the request
        try:
            _, wait_ms = await take_provider_quota(store, dep, state.tenant, int(held.get("t", 0)))
        except StoreUnavailable:
            return GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the admission store is unavailable")
        if wait_ms is None:
            return None
        count_admission(dep.deployment, "fallback", "shed_quota")
        return GatewayError(ErrorCode.OVERLOADED, f"the provider quota of {dep.deployment} is spent for now",
                            headers={RETRY_AFTER_HEADER: str(max(1, math.ceil(wait_ms / 1000)))})

    @staticmethod
    async def _record(store: Store, tenant: str, rid: str, n: int, record: dict[str, Any], hint: str) -> None:
        try:
            await store.record_attempt(tenant, rid, n, record, hint)
        except StoreUnavailable:
            # The attempt still runs: settlement records what Envoy reported of the last one.
            log.error("request %s: attempt %d not recorded (store unavailable)", rid, n)

    async def handle(self, first: ep.ProcessingRequest,
                     rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        live = self.live()
        state = _Attempt(live.snapshot, credentials=live.credentials, credential_errors=live.credential_errors)
        try:
            async for req in with_first(first, rest):
                try:
                    reply = state.answer(req)
                except GatewayError as err:  # final: Envoy does not retry an upstream filter's own reply
                    yield refuse_attempt(err)
                    return
                except Exception:
                    _errors.error("attempt filter: request %s attempt %d", state.rid, state.n, exc_info=True)
                    yield refuse_attempt(GatewayError(ErrorCode.POLICY_UNAVAILABLE,
                                                "the gateway could not address this attempt"))
                    return
                kind = req.WhichOneof("request")
                if kind == "request_headers" and (spent := await self._provider_quota(state)) is not None:
                    state.record["status"] = spent.status  # refused before it was sent: the ledger says why
                    self._record_later(state)
                    yield refuse_attempt(spent)
                    return
                if kind == "request_headers":
                    # Recorded as it starts (status 0 until its answer's headers): an attempt that
                    # times out is then in the store before the next one starts, not only when Envoy
                    # closes its stream, which on a loaded machine came after the settlement.
                    self._store(state)
                elif kind == "response_headers":
                    self._record_later(state)  # before the answer goes on, hence before any settlement
                if reply is None:
                    return
                yield reply
                if state.done(req):
                    return
        finally:
            # An attempt that ended without response headers (timeout, reset, connect failure) is
            # recorded now, with status 0: a write queued at once, long before the access log's flush.
            if not state.recorded:
                self._record_later(state)


@dataclass
class _Attempt:
    """What one attempt's filter stream knows, message by message."""

    snap: Snapshot
    credentials: Mapping[str, str] = field(default_factory=dict)  # the revision's, resolved when loaded
    credential_errors: Mapping[str, str] = field(default_factory=dict)
    tenant: str = ""
    rid: str = ""
    n: int = 1
    dep: Deployment | None = None
    record: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # the same, as the span's start
    trace: str = ""  # the request's trace context (metadata `trace`)
    hint: str = ""  # the reservation's hint (metadata `hold`): the token bound, the quotas admission took
    recorded: bool = False
    adapter: Adapter | None = None  # set when the candidate is of another API shape
    target: Target | None = None
    losses: str = ""  # what the candidate's adapter changes or loses of the request (its header)
    status: int = 0

    @staticmethod
    def done(req: ep.ProcessingRequest) -> bool:
        """Whether this attempt's filter has nothing more to do after answering req: the response
        headers are its last message."""
        return req.WhichOneof("request") == "response_headers"

    def answer(self, req: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(req)
        if kind == "request_body" and self.dep is not None:
            common = ep.CommonResponse()
            if self.adapter is None or self.target is None:
                body = body_for(req.request_body.body, self.dep)
            else:
                native = self.adapter.request(json.loads(req.request_body.body), self.target)
                body = native.body
                # What covers the body (a signature) is known only now.
                common.header_mutation.set_headers.extend(overwrite_header(k, v)
                                                          for k, v in native.signed_headers.items())
            if body is not None:
                common.body_mutation.body = body
            length = len(body if body is not None else req.request_body.body)
            common.header_mutation.set_headers.append(overwrite_header("content-length", str(length)))
            return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
        if kind == "response_headers" and self.dep is not None:
            status = header(req.response_headers.headers, ":status", "0")
            self.status = int(status) if status.isdigit() else 0
            self.record.update(status=self.status, first_byte_ms=round((time.monotonic() - self.started) * 1000, 1))
            # Each attempt's own request id, as its provider named it (a failed attempt's too).
            named = next((v for n in UPSTREAM_REQUEST_ID_HEADERS if (v := header(req.response_headers.headers, n))), "")
            if named:
                self.record[Key.UPSTREAM_REQUEST_ID.value] = plain_id(named)
            # An upstream's own header of the attempt filter's refusal mark must not pass for one.
            mutation = ep.HeaderMutation(set_headers=[overwrite_header(Header.DEPLOYMENT, self.dep.deployment)],
                                         remove_headers=[Header.ATTEMPT_REFUSED])
            if self.losses:
                mutation.set_headers.append(overwrite_header(Header.TRANSLATION_LOSS, self.losses))
            if self.adapter is not None and 200 <= self.status < 300:
                # The Lua answer filter translates it (extproc/lua/answers.lua), after the router.
                mutation.set_headers.extend((overwrite_header(Header.ANSWER_SHAPE, self.adapter.name),
                                             overwrite_header(Header.ANSWER_MODEL, self.dep.served_model)))
            else:  # an upstream's own headers of those names must not choose a translation
                mutation.remove_headers.extend((Header.ANSWER_SHAPE, Header.ANSWER_MODEL))
            return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
                header_mutation=mutation)))
        _errors.warning("attempt filter: unexpected message %s", kind)
        return None

    def _request_headers(self, req: ep.ProcessingRequest) -> ep.ProcessingResponse:
        snap = self.snap
        attrs = req.attributes.get(Filter.EXT_PROC) if req.attributes else None
        self.tenant, plan = decode_plan(md_attr(attrs, Key.PLAN))
        self.rid = attr(attrs, "request.id")
        self.trace = md_attr(attrs, Key.TRACE)
        self.hint = md_attr(attrs, Key.HOLD)
        count = header(req.request_headers.headers, ATTEMPT_COUNT_HEADER, "1")
        self.n = n = int(count) if count.isdigit() else 1
        dep = self.dep = snap.deployments[plan[choose_candidate(snap, plan, n, attr(attrs, HOST_CLUSTER))]]
        # The candidate the previous attempt went to (by the composite's order).
        previous = snap.deployments.get(plan[min(n - 1, len(plan)) - 1]) if n > 1 else None
        self.record = {"n": n, "deployment": dep.deployment, "adapter": dep.fingerprint.adapter,
                       "kind": attempt_kind(previous, dep), "status": 0}
        self.losses = str(json.loads(md_attr(attrs, Key.LOSSES) or "{}").get(dep.deployment, ""))
        if self.losses:  # the ledger lists, per attempt, what its candidate's adapter changed or lost
            self.record["translation_loss"] = self.losses.split(", ")
        # Retries reuse the request's headers: what an earlier attempt set for its candidate (a
        # credential above all) must not reach this one.
        mutation = ep.HeaderMutation()
        token = ""
        if dep.credential_ref:
            if dep.deployment not in self.credentials:
                raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, self.credential_errors.get(
                    dep.deployment, f"credential reference {dep.credential_ref} is not resolved"))
            token = self.credentials[dep.deployment]
        if translated(dep):
            self.adapter = adapter_for(dep.fingerprint.adapter)
            self.target = Target(dep.served_model, token, dep.fingerprint.adapter_options,
                                 md_attr(attrs, Key.PLAN_STREAM) == "1")
            path, headers = self.adapter.endpoint(self.target)
            mutation.remove_headers.append("authorization")
            mutation.set_headers.extend(overwrite_header(k, v) for k, v in (*headers.items(), (":path", path)))
        else:
            # An OpenAI-shaped candidate after one of another shape: back to the chat path.
            mutation.set_headers.append(overwrite_header(":path", CHAT_PATH))
            headers = {}
            if token:
                mutation.set_headers.append(overwrite_header("authorization", f"Bearer {token}"))
            else:
                mutation.remove_headers.append("authorization")
        # An earlier attempt's candidate of another shape set its own key and protocol headers, and
        # Envoy reuses them for this one: none of them may reach a candidate they were not for.
        mutation.remove_headers.extend(h for h in REQUEST_HEADERS if h not in headers)
        reply = ep.ProcessingResponse(request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation)))
        if self.adapter is not None:  # the filter's own mode: the request body comes to be translated
            return reply
        first_candidate = snap.deployments.get(plan[0])
        if first_candidate is not None and first_candidate.served_model == dep.served_model:
            # The body was written for this model: no body message, one round trip less.
            reply.mode_override.CopyFrom(_PM(**ATTEMPT_WITHOUT_BODY))
        return reply
