"""Per-request state. One Exchange per HTTP request, created when its ext_proc stream starts and
dropped when the stream ends; every stage reads and writes it, nothing else holds request state."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.answer_checks import CheckSpec
from extproc.bounds import Bound
from extproc.config import Snapshot
from extproc.config.plans import encode_plan, uses_attempt_filter
from extproc.config.policy import Decision
from extproc.config.schema import Deployment, Route
from extproc.embeddings import Embedding
from extproc.names import POOL_ANSWER_SHAPE, POOL_CLUSTER_PREFIX, Key, Settle
from extproc.redact import log_safe
from extproc.replay import Sealer
from extproc.reservation import Held
from extproc.shadow import Grant
from extproc.shapes.door import path_of
from extproc.shapes.loss import Loss
from extproc.shapes.registry import DOORS_BY_NAME
from extproc.store import idempotency_key_sha256
from extproc.tracing import context_value

MAX_LOGGED_REASONS = 8
STREAM_END_GRACE_MS = 250  # after a stream's end time, Envoy resets what the stream guard has ended


@dataclass(frozen=True, slots=True)
class Identity:
    tenant: str
    subject: str  # the API key's id or the JWT's subject claim
    kind: str  # "api_key" or "jwt"
    groups: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()  # tool effects the caller is granted


@dataclass(slots=True)
class Exchange:
    snapshot: Snapshot  # taken when the stream starts: the whole request sees one revision
    cache_salts: Mapping[str, str] = field(default_factory=dict)  # tenant -> prefix-cache salt
    sealer: Sealer = field(default_factory=lambda: Sealer(None))  # opens idempotent answers kept for replay
    shadow_key: bytes = b""  # checks a shadow copy's grant and signs the grants of the copies this one makes
    region: str = ""  # the region of the gateway deciding it ("" = not declared)
    request_id: str = ""
    method: str = ""
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # the request headers ext_proc was sent
    arrived_at: float = field(default_factory=time.time)  # wall clock at Envoy (request.time), when sent
    # When this worker took the message (monotonic): Envoy waits for the decision only
    # `envoy.extproc_message_timeout_ms`, then answers 503 itself and the request goes nowhere.
    received_at: float = field(default_factory=time.monotonic)
    remaining_ms: int = 0  # of the effective deadline, when ext_proc admitted the request
    raw_body: bytes = b""
    door: str = ""  # the front door the client used (extproc/shapes/*/door.py), "" for chat completions
    body: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    n: int = 1  # completions asked for: each may run to the completion bound (invariant 3)
    deadline_ms: int | None = None  # x-llmgw-deadline-ms, parsed by intake
    idempotency_key: str | None = None
    replied: bool = False  # the decision answered it itself (refusal, degraded answer): Settle.DECIDED
    degraded: str = ""  # `route:NAME` when the route's degraded route serves it (no candidate of its own qualified)
    # Candidates the route stage left out, with every check each failed (`evidence`, and the run-time
    # trigger that voided it: `engine_mismatch`, ...): the ledger names why a request went elsewhere or nowhere.
    disqualified: str = ""  # `pool-llama-8b: engine_mismatch, evidence; other: data_class`
    canary: str = ""  # on a route with a canary: `canary` when it goes there first, else `stable`
    # How admission (extproc/admission.py) let it through, when not at once: `queued_ms=120`,
    # `skipped=pool-llama-8b:overloaded`, `shed=queue_timeout` (ledger, metadata); "" = admitted at once.
    admission: str = ""
    plan: Any = None  # the route stage's plan, for the stages after admission (stages/route.py: Planned)
    # A pool slot asked for in the reservation's write (stages/budget.py), for the route's first candidate:
    # (its pool, whether the store granted it). Admission uses the answer instead of asking again.
    early_slot: tuple[str, bool] | None = None
    waiting: Any = None  # admission queued it: the wait the server runs between two stages (admission.Waiting)
    shadow_of: Grant | None = None  # this request is a shadow copy: the grant it came with
    shadow: str = ""  # the shadow candidate this request is copied to ("" = not shadowed)
    shadow_grant: str = ""  # the copy's grant, for Envoy's mirror policy
    traceparent: str = ""  # the client's W3C trace context, only when valid ("" otherwise)
    tracestate: str = ""
    # The request's trace (extproc/tracing.py): the client's continued, or a new one; the id of the
    # gateway's own span for the request, decided now (its attempts' spans and the upstream name it).
    trace_id: str = ""
    span_id: str = ""
    identity: Identity | None = None
    data_class: str = ""
    client_metadata: dict[str, str] = field(default_factory=dict)  # the request's `metadata` (client_fields.py)
    count: bool = False  # a door's token count (count_tokens, countTokens): counted upstream, nothing generated
    operation: str = "chat"  # or "embeddings" (POST /v1/embeddings): each input a message, nothing generated
    unserved: bool = False  # asked on a path the gateway does not serve: the ledger names the endpoint
    embedding: Embedding | None = None  # an embeddings request's own options (extproc/embeddings.py)
    native: dict[str, Any] | None = None  # a door's provider-only fields, for a plan of its shape (loss.NATIVE)
    effects: tuple[str, ...] = ()  # effects of the tools the request offers (from the catalog)
    client: str | None = None  # the agent a tool pack recognised by its User-Agent (extproc/tool_catalog.py)
    tool_namespaces: tuple[str, ...] = ()  # the Responses door's namespaces of tools (Key.NAMESPACES)
    answer_checks: CheckSpec | None = None  # what its answer is checked against (tools, a JSON format)
    decision: Decision | None = None  # the authorization decision, recorded for the ledger
    decision_id: str = ""  # this request's decision (a UUID): error body, access log, ledger, decision log
    redactions: dict[str, int] = field(default_factory=dict)  # entity type -> values replaced
    bound: Bound | None = None  # invariant 3's bound, before redaction (stages/size.py)
    held: Held | None = None  # the budget reservation, once the store granted it
    reserve_unknown: bool = False  # the reserve's reply was lost: a reservation may stand
    route: Route | None = None
    deployment: Deployment | None = None  # the first candidate
    candidates: tuple[Deployment, ...] = ()  # every qualified candidate, in the route's order
    # deployment -> what its adapter changes or loses of this request (extproc/shapes/loss.py)
    translation_losses: dict[str, tuple[Loss, ...]] = field(default_factory=dict)
    refused_field: str = ""  # the field the decision's own refusal names
    cluster: str = ""
    cache_salt: str = ""  # the tenant's prefix-cache salt, set with the route
    endpoints: list[str] = field(default_factory=list)  # the picker's order within the pool, best first
    upstream_body: bytes | None = None  # the body as the upstream must receive it, when rewritten
    # Translated by the decision (extproc/direct.py): the provider's path and headers, its answer's shape.
    upstream_headers: dict[str, str] | None = None
    answer_shape: str = ""
    credentials: Mapping[str, str] = field(default_factory=dict)  # deployment -> its resolved credential
    credential_errors: Mapping[str, str] = field(default_factory=dict)
    withhold_usage: bool = False  # the gateway asked for the stream's usage chunk; the client did not
    retry_on: str = ""  # Envoy's retry conditions for this request ("" = none)
    retriable_codes: str = ""
    max_retries: int = 0
    stage_us: dict[str, float] = field(default_factory=dict)

    def route_asked(self) -> str:
        """The route a request names, once it was routed or where a refusal came first: its body's
        `model` (read again from the raw body when intake refused it before parsing it whole), or a
        Gemini caller's path. Only a route of the snapshot: a refusal's ledger entry and metrics are
        counted per route, and a name the caller made up is none."""
        if self.route is not None:
            return self.route.route_contract
        name: Any = self.body.get("model")
        if name is None:
            door = DOORS_BY_NAME.get(self.door)
            named = door and re.fullmatch(door.path, path_of(self.path))
            if named and named.groups():
                name = urllib.parse.unquote(named.group(1))
            elif self.raw_body[:1] == b"{":
                with contextlib.suppress(ValueError):
                    name = orjson.loads(self.raw_body).get("model")
        return name if isinstance(name, str) and name in self.snapshot.routes else ""

    def logged_reasons(self) -> list[str]:
        """The decision's reasons as logs and the ledger keep them: a policy may quote what the client
        sent (a tool's name), so each is made log-safe (extproc/redact.py) and there are at most 8."""
        reasons = self.decision.reasons if self.decision is not None else ()
        return [log_safe(r) for r in reasons[:MAX_LOGGED_REASONS]]

    @property
    def trace_context(self) -> str:
        """The request's trace as the metadata carries it (extproc/tracing.py): the trace, the
        gateway's span for the request, and the client's span, its parent ("" for a new trace)."""
        return context_value(self.trace_id, self.span_id, self.traceparent[36:52])

    @property
    def idempotency_key_sha256(self) -> str:
        """The Idempotency-Key as the store and the ledger name it ("" without one)."""
        return idempotency_key_sha256(self.idempotency_key) if self.idempotency_key is not None else ""

    def ledger_facts(self) -> dict[str, Any]:
        """What the ledger records about the request itself (invariant 8, docs/INVARIANTS.md); never content."""
        facts: dict[str, Any] = {
            "request_id": self.request_id, "trace_id": self.trace_id, "span_id": self.span_id,
            "parent_span_id": self.traceparent[36:52],
            "time": round(self.arrived_at, 3), "route_revision": self.snapshot.revision,
            "data_class": self.data_class, "stream": self.stream,
        }
        if self.operation != "chat":  # what was asked of the upstream: embeddings generate nothing
            facts["operation"] = self.operation
        if self.unserved:  # what the caller asked for instead (its query string aside: a key may be in it)
            facts["endpoint"] = log_safe(f"{self.method} {path_of(self.path)}")
        if self.region:
            facts["region"] = self.region
        if self.identity is not None:
            facts.update(tenant=self.identity.tenant, subject=self.identity.subject, identity_kind=self.identity.kind)
        if self.route is not None:
            facts.update(route=self.route.route_contract, request_class=self.route.request_class)
        elif asked := self.route_asked():  # refused before routing: the route it asked for, if one
            facts["route"] = asked
        if self.client_metadata:  # the caller's own tags (OpenAI's `metadata`), made log-safe
            facts["metadata"] = {log_safe(k): log_safe(v) for k, v in self.client_metadata.items()}
        if self.shadow_of is not None:  # a shadow copy: the request it copies
            facts["shadow_of"] = self.shadow_of.of
        if self.effects:  # what the offered tools can change, and the key to reconcile an ambiguous outcome by
            facts["effects"] = list(self.effects)
            if self.idempotency_key is not None:
                facts["idempotency_key"] = self.idempotency_key
        if sha := self.idempotency_key_sha256:  # the store's name for the key: `llmgw ledger get` finds it by it
            facts["idempotency_key_sha256"] = sha
        if self.disqualified:
            facts[Key.DISQUALIFIED.value] = self.disqualified
        if self.admission:
            facts[Key.ADMISSION.value] = self.admission
        if self.decision is not None:
            facts["decision"] = {"allow": self.decision.allow, "reasons": self.logged_reasons(),
                                 "policy_revision": self.decision.policy_revision, "decision_id": self.decision_id}
        elif self.decision_id:  # the policy failed: this id names the failure in the decision log
            facts["decision"] = {"error": "policy_unavailable", "decision_id": self.decision_id}
        return facts

    def metadata(self) -> dict[str, Any]:
        """What Envoy keeps for routing, response headers and its access log (io.llmgw namespace)."""
        md: dict[str, Any] = {Key.REVISION: self.snapshot.revision, Key.REQUEST_ID: self.request_id}
        if self.identity is not None:
            md[Key.TENANT] = self.identity.tenant
            md[Key.SUBJECT] = self.identity.subject
        if self.decision is not None:
            md[Key.DECISION] = "allow" if self.decision.allow else "deny"
            md[Key.POLICY_REVISION] = self.decision.policy_revision
            if self.decision.reasons:
                md[Key.REASONS] = "; ".join(self.logged_reasons())
        if self.decision_id:
            md[Key.DECISION_ID] = self.decision_id
        if self.shadow:
            md[Key.SHADOW], md[Key.SHADOW_GRANT] = self.shadow, self.shadow_grant
        if self.redactions:
            md[Key.REDACTIONS] = ",".join(f"{k}={v}" for k, v in sorted(self.redactions.items()))
        if self.held is not None or self.answer_checks is not None:
            if self.held is not None:
                md[Key.HOLD] = self.held.hint  # only requests that hold a reservation are settled
            md[Key.SETTLE] = self.settled_by()
            if self.answer_checks is not None:  # read by the filter that checks the answer
                md[Key.CHECKS] = self.answer_checks.encode()
            if self.stream:
                md[Key.STREAM] = "1"
                if self.withhold_usage:
                    md[Key.WITHHOLD_USAGE] = "1"
        if self.route is not None:
            md[Key.ROUTE] = self.route.route_contract
        if self.refused_field:
            md[Key.REFUSED_FIELD] = self.refused_field
        if self.door:
            md[Key.DOOR] = self.door
            if self.tool_namespaces:
                md[Key.NAMESPACES] = ",".join(self.tool_namespaces)
        if self.degraded:
            md[Key.DEGRADED] = self.degraded
        if self.disqualified:
            md[Key.DISQUALIFIED] = self.disqualified
        if self.admission:
            md[Key.ADMISSION] = self.admission
        if self.canary:
            md[Key.CANARY] = self.canary
        if self.deployment is not None:
            md[Key.DEPLOYMENT] = self.deployment.deployment
        if self.cluster:
            md[Key.CLUSTER] = self.cluster
        if self.count and self.upstream_headers is not None:
            # Read by Envoy's Lua answer filter, which sets these headers (its path among them) on the
            # request and translates nothing; the door filter reads the count from the answer of this shape.
            md[Key.UPSTREAM_HEADERS] = self.upstream_headers
            md[Key.COUNT] = self.answer_shape
        elif self.upstream_headers is not None and self.deployment is not None:
            # Read by Envoy's Lua answer filter (extproc/lua/answers.lua), which blanks the headers once set.
            md[Key.UPSTREAM_HEADERS] = self.upstream_headers
            md[Key.ANSWER_SHAPE], md[Key.ANSWER_MODEL] = self.answer_shape, self.deployment.served_model
            if self.stream:
                md[Key.PLAN_STREAM] = "1"
        elif (self.cluster.startswith(POOL_CLUSTER_PREFIX) and self.operation == "chat" and not self.count
              and self.settled_by() is Settle.ACCESS_LOG):  # (a JSON answer: a stream settles otherwise)
            # A pool engine's JSON answer is read by Envoy's Lua answer filter as the OpenAI shape: a 2xx
            # that is no chat completion becomes the contract's 502 (charged as the work it may have been).
            md[Key.ANSWER_SHAPE] = POOL_ANSWER_SHAPE
        elif uses_attempt_filter(self.candidates) and self.identity is not None:
            # Read by the upstream filter of each attempt (extproc/service/attempts.py).
            md[Key.PLAN] = encode_plan(self.identity.tenant, [d.deployment for d in self.candidates])
            if self.stream:
                md[Key.PLAN_STREAM] = "1"
            if self.translation_losses:
                md[Key.LOSSES] = orjson.dumps({d: ", ".join(map(str, x)) for d, x in self.translation_losses.items()
                                               }).decode()
        if Key.PLAN not in md and self.deployment is not None:
            # One candidate, no attempt filter: what translating to it lost, for the answer's
            # x-llmgw-translation-loss (the route's response headers) and the ledger.
            lost = self.translation_losses.get(self.deployment.deployment)
            if lost:
                md[Key.TRANSLATION_LOSS] = ", ".join(map(str, lost))
        if self.remaining_ms:
            # Read by the request-side header mutation after the buffer filter (Envoy's router).
            md[Key.PER_TRY_TIMEOUT_MS if self.stream else Key.RQ_TIMEOUT_MS] = str(self.remaining_ms)
        if self.stream and self.route is not None:
            # A stream lasts at most max_stream_ms from its arrival: the stream guard ends it there with
            # the contract's event, and Envoy's timer (the whole request's timeout) resets it a little
            # later, so the engine stops generating even when no chunk comes to carry the event.
            ends_at_ms = int(self.arrived_at * 1000) + self.route.max_stream_ms
            md[Key.STREAM_ENDS_AT_MS] = str(ends_at_ms)
            md[Key.RQ_TIMEOUT_MS] = str(max(1, ends_at_ms - int(time.time() * 1000)) + STREAM_END_GRACE_MS)
        if self.trace_id:
            md[Key.TRACE] = self.trace_context
        if self.trace_id and self.route is not None and self.route.telemetry.propagate_trace_context:
            # Re-added upstream by Envoy (the client's own is dropped): the upstream's parent is the
            # gateway's span for the request; the client's sampling flag is kept.
            flags = self.traceparent[53:55] if self.traceparent else "01"
            md[Key.TRACEPARENT] = f"00-{self.trace_id}-{self.span_id}-{flags}"
            if self.tracestate:
                md[Key.TRACESTATE] = self.tracestate
        if self.route is not None:  # always set: they overwrite whatever the client sent
            md[Key.RETRY_ON] = self.retry_on
            md[Key.RETRIABLE_CODES] = self.retriable_codes
            md[Key.MAX_RETRIES] = str(self.max_retries)
        return md

    def settled_by(self) -> Settle:
        """Streams and idempotent answers need their body read (usage chunks, the recorded answer); a
        JSON answer's usage reaches settlement through the access log. A stream with an Idempotency-Key
        keeps what the client received for replay: ext_proc's stream guard; any other stream: the Lua
        stream guard in Envoy, with no round trip per chunk. An answer to check: the ext_proc filters,
        which read what came back before the client does (and keep it when idempotent)."""
        if self.replied:  # no upstream is reached: the deciding worker releases what it reserved
            return Settle.DECIDED
        idempotent = self.held is not None and self.held.idempotent
        if self.answer_checks is not None:
            return Settle.CHECKED_STREAM if self.stream else Settle.CHECKED
        if self.stream:
            return Settle.KEPT_STREAM if idempotent else Settle.STREAM
        return Settle.METERED if idempotent else Settle.ACCESS_LOG
