"""Names on the wire between ext_proc, Envoy and its native filters: the keys of the io.llmgw dynamic
metadata and their fixed values. The data plane, the renderer (llmgw/render/bootstrap.py) and the Lua
stream guard (extproc/lua/stream_guard.lua, which gets them rendered in) all take them from here, so a
misspelt key is an AttributeError, not a value that silently reads as empty."""

from __future__ import annotations

from enum import StrEnum


class Key(StrEnum):
    """Keys of the io.llmgw metadata namespace (extproc/contract.py's METADATA_NAMESPACE)."""

    # Set by the decision (extproc/exchange.py), read by Envoy's routes, headers and access logs.
    REVISION = "revision"
    REQUEST_ID = "request_id"
    TENANT = "tenant"
    SUBJECT = "subject"
    DECISION = "decision"
    DECISION_ID = "decision_id"
    POLICY_REVISION = "policy_revision"
    REASONS = "reasons"
    REDACTIONS = "redactions"
    HOLD = "hold"  # the reservation's hint: only requests holding one are settled
    SETTLE = "settle"  # how it settles: a Settle value
    STREAM = "stream"  # "1" for a streamed answer
    STREAM_ENDS_AT_MS = "stream_ends_at_ms"  # epoch ms: the stream guard ends the stream there
    WITHHOLD_USAGE = "withhold_usage"  # "1": the usage chunk was asked for on the client's behalf
    ROUTE = "route"
    DOOR = "door"  # the front door the client used (extproc/doors/), for the door filter
    DEPLOYMENT = "deployment"
    CLUSTER = "cluster"  # the cluster the request was admitted to (routes match on it)
    PLAN = "plan"  # a fallback route's candidates, for the attempt filter
    LOSSES = "losses"  # per candidate, what its adapter loses or changes (JSON), for the attempt filter
    CANARY = "canary"  # on a route with a canary: `canary` (it was tried first) or `stable` (ledger)
    SHADOW = "shadow"  # the shadow candidate a copy goes to: selects the admitted route with the mirror policy
    SHADOW_GRANT = "shadow_grant"  # the copy's grant (extproc/shadow.py), added to the copy by the mirror
    DEGRADED = "degraded"  # the route's degraded answer served it: `route:NAME` (x-llmgw-degraded, ledger)
    PLAN_STREAM = "plan_stream"  # "1": the plan's answer is a stream (translated chunk by chunk)
    # A lone candidate of another shape, translated without the attempt filter (extproc/direct.py): the
    # request headers its shape needs (`:path`, its key), which Envoy's Lua answer filter sets and then
    # blanks; the shape of its answer, the model to name when the answer names none, and what the
    # translation lost (x-llmgw-translation-loss, the ledger).
    UPSTREAM_HEADERS = "upstream_headers"
    ANSWER_SHAPE = "answer_shape"
    ANSWER_MODEL = "answer_model"
    TRANSLATION_LOSS = "translation_loss"
    RQ_TIMEOUT_MS = "rq_timeout_ms"
    PER_TRY_TIMEOUT_MS = "per_try_timeout_ms"
    TRACE = "trace"  # the request's trace: `trace_id:span_id:parent_span_id` (extproc/tracing.py)
    TRACEPARENT = "traceparent"
    TRACESTATE = "tracestate"
    RETRY_ON = "retry_on"
    RETRIABLE_CODES = "retriable_codes"
    MAX_RETRIES = "max_retries"
    # Set by Envoy's filters on the response: json_to_metadata (a JSON answer's usage) and the
    # stream guards (a stream's usage, its chunk count, how it ended).
    USAGE_PROMPT = "usage_prompt"
    USAGE_COMPLETION = "usage_completion"
    USAGE_CACHED = "usage_cached"
    STREAM_CHUNKS = "stream_chunks"
    STREAM_END = "stream_end"  # a StreamEnd value; absent: Envoy cut the stream
    # "1": a Lua filter found a 2xx answer broken (the answer filter: a provider's; the door filter: one
    # the door cannot carry) and answered 502 instead - the upstream did the work it was asked: settled
    # as an ambiguous outcome, never released.
    ANSWER_BROKEN = "answer_broken"
    # The status of the answer's headers as the upstream sent them (the last attempt's), set by the
    # Lua filter nearest the router before anything else in Envoy sees or replaces them: settlement
    # charges a 2xx as the work it was, whatever Envoy did to the answer afterwards.
    UPSTREAM_STATUS = "upstream_status"


class Settle(StrEnum):
    """Who settles an admitted request (the route it takes turns on the response filter it needs)."""

    ACCESS_LOG = "als"  # a JSON answer: its usage reaches the access log through json_to_metadata
    METERED = "metered"  # an idempotent JSON answer: the meter records it for replay, then settles
    STREAM = "stream"  # a stream: the Lua stream guard in Envoy, settled from the access log
    KEPT_STREAM = "kept_stream"  # an idempotent stream: the ext_proc stream guard records it for replay


class StreamEnd(StrEnum):
    """How the Lua stream guard saw a stream end (Key.STREAM_END)."""

    DONE = "done"
    MALFORMED = "malformed"
    ERROR = "error"
    OVERSIZED = "oversized"
    UNFINISHED = "unfinished"
    OVER = "over"  # past its end time (max_stream_ms)


# Why a stream ended early, as its `stream_interrupted` event says it.
INTERRUPTED: dict[StreamEnd, str] = {
    StreamEnd.MALFORMED: "the upstream sent a malformed event",
    StreamEnd.ERROR: "the upstream reported an error mid-stream",
    StreamEnd.OVERSIZED: "the upstream sent an oversized event",
    StreamEnd.UNFINISHED: "the upstream ended the stream without finishing it",
    StreamEnd.OVER: "the stream reached the route's maximum duration (max_stream_ms)",
}
