"""Names on the wire between ext_proc, Envoy and its native filters: the keys of the io.llmgw dynamic
metadata and their fixed values, the headers the gateway names, the filters' and clusters' names, the
CEL paths ext_proc asks Envoy for, and the few wire values both sides must agree on. The data plane,
the renderer (llmgw/render/) and the Lua filters (extproc/lua/, which get them rendered in) all take
them from here, so a misspelt name is an AttributeError, not a value that silently reads as empty.
The external contract's own (the error codes, the headers on every answer) are in contract.py;
tests/unit/test_layout.py keeps `x-llmgw-` header names from being spelled anywhere else."""

from __future__ import annotations

from enum import StrEnum

from extproc.contract import METADATA_NAMESPACE


class Header(StrEnum):
    """Headers the gateway names (besides contract.py's on every answer and refusal)."""

    DATA_CLASS = "x-llmgw-data-class"  # request: the data class the caller declares
    DEADLINE_MS = "x-llmgw-deadline-ms"  # request: the caller's remaining deadline
    DEPLOYMENT = "x-llmgw-deployment"  # answer: the deployment that answered
    ATTEMPTS = "x-llmgw-attempts"  # answer: how many attempts Envoy made
    DEGRADED = "x-llmgw-degraded"  # answer: the route's degraded answer gave it (`response`, `route:NAME`)
    TRANSLATION_LOSS = "x-llmgw-translation-loss"  # answer: what translating to the candidate's shape lost
    IDEMPOTENT_REPLAY = "x-llmgw-idempotent-replay"  # answer: replayed for a repeated Idempotency-Key
    ANSWER_CHECKS = "x-llmgw-answer-checks"  # answer: the checks it failed, on a route that reports them
    SHADOW_GRANT = "x-llmgw-shadow-grant"  # a shadow copy's grant, added by Envoy's mirror
    # Set on a translated candidate's 2xx answer for the Lua answer filter, which reads and removes them.
    ANSWER_SHAPE = "x-llmgw-answer-shape"
    ANSWER_MODEL = "x-llmgw-answer-model"
    # Set on the attempt filter's own refusal of an attempt (a candidate's spent provider quota, a host no
    # candidate's): the Lua filter nearest the router reads and removes it, marking the request's metadata
    # (Key.ATTEMPT_REFUSED) so custom_response leaves the contract's error as the gateway wrote it.
    ATTEMPT_REFUSED = "x-llmgw-attempt-refused"


# Envoy numbers each attempt on its request (the virtual host's include_request_attempt_count), and
# tells a response filter how many there were (a CEL attribute).
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
ATTEMPT_COUNT = "upstream.request_attempt_count"


class Filter(StrEnum):
    """HTTP filters by the names the rendered bootstrap gives them: the gateway's own, and Envoy's."""

    UPSTREAM_HEADERS = "llmgw.upstream_headers"  # header_mutation: the request's header allow-list
    METER = "llmgw.meter"  # ext_proc: an idempotent or checked JSON answer, before the client has it
    STREAMS = "llmgw.streams"  # ext_proc: an idempotent or checked stream's guard
    LUA_STREAM_GUARD = "llmgw.lua_streams"
    LUA_ANSWERS = "llmgw.lua_answers"
    LUA_DOORS = "llmgw.lua_doors"
    UPSTREAM_STATUS = "llmgw.upstream_status"
    ATTEMPT = "llmgw.attempt"  # ext_proc on the composite clusters' upstream filter chain
    EXT_PROC = "envoy.filters.http.ext_proc"  # the decision; also where a message's CEL attributes are keyed
    HEADER_MUTATION = "envoy.filters.http.header_mutation"
    BUFFER = "envoy.filters.http.buffer"
    JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"
    CUSTOM_RESPONSE = "envoy.filters.http.custom_response"
    ROUTER = "envoy.filters.http.router"
    UPSTREAM_CODEC = "envoy.filters.http.upstream_codec"
    HTTP_CONNECTION_MANAGER = "envoy.filters.network.http_connection_manager"


EXTPROC_CLUSTER = "llmgw_extproc"  # the ext_proc workers
SHADOW_CLUSTER = "llmgw_shadow"  # Envoy's cluster back to its own listener, for shadow copies
# How Envoy's response code details begin when it answered a request itself because its ext_proc
# decision failed (a gRPC error, the message timeout): no decision reached Envoy, no upstream saw it.
EXTPROC_FAILED = "ext_proc"
# The endpoint picker's choice, as the Gateway API Inference Extension names it: a header, and the
# metadata namespace the pool's original-destination load balancer reads it from.
LB_NAMESPACE = "envoy.lb"
LB_KEY = "x-gateway-destination-endpoint"

# CEL paths ext_proc asks Envoy for (request_attributes / response_attributes).
MD = f"metadata.filter_metadata['{METADATA_NAMESPACE}']"  # the request's io.llmgw metadata
HOST_CLUSTER = f"xds.upstream_host_metadata.filter_metadata['{METADATA_NAMESPACE}']['cluster']"  # the host's


REQUEST_HEADER = "request.headers['"  # the CEL path of a request header: this, its name, "']"
USER_AGENT = "user-agent"  # the client's name for itself: the tool packs recognise agents by it


def metadata_path(key: str) -> str:
    """The CEL path of one key of the request's io.llmgw metadata."""
    return f"{MD}['{key}']"


def request_attributes(credential_headers: tuple[str, ...]) -> tuple[str, ...]:
    """What the decision asks Envoy for on the body message (the whole header map is not
    serializable): the request's own attributes and the headers ext_proc reads, the front doors'
    credential headers among them."""
    headers = ("authorization", *credential_headers, Header.DATA_CLASS, "idempotency-key", Header.DEADLINE_MS,
               "traceparent", "tracestate", Header.SHADOW_GRANT, USER_AGENT)
    return ("request.id", "request.path", "request.method", "request.time",
            *(f"{REQUEST_HEADER}{h}']" for h in headers))


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
    DOOR = "door"  # the front door the client used (extproc/shapes/*/door.py), for the door filter
    # The Responses door's tool namespaces (comma-separated): a call to `ns__fn` is answered as
    # `fn` in namespace `ns` (extproc/shapes/openai/door.py).
    NAMESPACES = "namespaces"
    COUNT = "count"  # a token count: the shape of the upstream that counts (its answer's field), for the door filter
    DEPLOYMENT = "deployment"
    CLUSTER = "cluster"  # the cluster the request was admitted to (routes match on it)
    PLAN = "plan"  # a fallback route's candidates, for the attempt filter
    LOSSES = "losses"  # per candidate, what its adapter loses or changes (JSON), for the attempt filter
    CANARY = "canary"  # on a route with a canary: `canary` (it was tried first) or `stable` (ledger)
    DISQUALIFIED = "disqualified"  # candidates the route left out and why: `dep: evidence, engine_mismatch; ...`
    ADMISSION = "admission"  # how admission let it through when not at once: `queued_ms=120`, `skipped=...`
    SHADOW = "shadow"  # the shadow candidate a copy goes to: selects the admitted route with the mirror policy
    SHADOW_GRANT = "shadow_grant"  # the copy's grant (extproc/shadow.py), added to the copy by the mirror
    DEGRADED = "degraded"  # the route's degraded answer served it: `route:NAME` (x-llmgw-degraded, ledger)
    PLAN_STREAM = "plan_stream"  # "1": the plan's answer is a stream (translated chunk by chunk)
    CHECKS = "checks"  # what the answer is checked against (answer_checks.CheckSpec, encoded)
    # A lone candidate of another shape, translated without the attempt filter (extproc/direct.py): the
    # request headers its shape needs (`:path`, its key), which Envoy's Lua answer filter sets and then
    # blanks; the shape of its answer, the model to name when the answer names none, and what the
    # translation lost (x-llmgw-translation-loss, the ledger).
    UPSTREAM_HEADERS = "upstream_headers"
    ANSWER_SHAPE = "answer_shape"
    ANSWER_MODEL = "answer_model"
    TRANSLATION_LOSS = "translation_loss"
    REFUSED_FIELD = "refused_field"  # the field the decision's own refusal names (the ledger's `field`)
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
    # The token classes priced apart (extproc/settlement/charge.py `token_classes`): cache writes at the 5-minute
    # (or only) rate and at the 1-hour rate, and reasoning among the completion tokens.
    USAGE_CACHE_WRITE = "usage_cache_write"
    USAGE_CACHE_WRITE_1H = "usage_cache_write_1h"
    USAGE_REASONING = "usage_reasoning"
    STREAM_CHUNKS = "stream_chunks"
    # Epoch microseconds (as text) at which a stream's first content (text, a tool call, reasoning)
    # reached the stream guard: its time to first token. Engines send headers and an empty role chunk
    # before queueing and prefill finish, so Envoy's first downstream byte (time to headers, kept beside
    # it) cannot show a prefill.
    FIRST_TOKEN_AT_US = "first_token_at_us"
    # The upstream's own id for its answer (a JSON answer's `id`, a stream's first chunk's) and a stream's
    # finish reason (the Lua stream guard): the attempt's ledger record keeps them.
    UPSTREAM_ID = "upstream_id"
    # The model the upstream says answered (a JSON answer's `model`, a stream's first chunk's; a
    # translated answer's as its provider named it): the engine check compares it with the deployment's.
    UPSTREAM_MODEL = "upstream_model"
    FINISH_REASON = "finish_reason"
    # A translated answer's finish reason as its provider wrote it (the Lua answer filter): beside the
    # normalised one, in the attempt's ledger record.
    NATIVE_FINISH_REASON = "native_finish_reason"
    # The upstream's own request id, from its answer's headers (UPSTREAM_REQUEST_ID_HEADERS), recorded
    # nearest the router with the upstream's status.
    UPSTREAM_REQUEST_ID = "upstream_request_id"
    STREAM_END = "stream_end"  # a StreamEnd value; absent: Envoy cut the stream
    # "1": a Lua filter found a 2xx answer broken (the answer filter: a provider's; the door filter: one
    # the door cannot carry) and answered 502 instead - the upstream did the work it was asked: settled
    # as an ambiguous outcome, never released.
    ANSWER_BROKEN = "answer_broken"
    # The status of the answer's headers as the upstream sent them (the last attempt's), set by the
    # Lua filter nearest the router before anything else in Envoy sees or replaces them: settlement
    # charges a 2xx as the work it was, whatever Envoy did to the answer afterwards.
    UPSTREAM_STATUS = "upstream_status"
    # Why an upstream refused the request as invalid or too large, as its answer said it (secrets
    # redacted, bounded): the caller's error carries it, and the attempt's ledger record.
    UPSTREAM_MESSAGE = "upstream_message"
    # "1": the last attempt's answer is the attempt filter's own refusal, not an upstream's (its error is
    # the contract's already: custom_response leaves it alone).
    ATTEMPT_REFUSED = "attempt_refused"


# Where providers name their request (Anthropic's `request-id`, AWS's `x-amzn-requestid`, OpenAI's and
# vLLM's `x-request-id`, Azure's `apim-request-id`): the first present is the attempt's request id.
UPSTREAM_REQUEST_ID_HEADERS = ("request-id", "x-amzn-requestid", "x-request-id", "apim-request-id")


# A pool's cluster is named `pool_<pool>` (config.loader pool_of); its engines answer in the OpenAI shape,
# which the Lua answer filter reads a pool's JSON answer as (issue 31: a 2xx that is no answer is a 502).
POOL_CLUSTER_PREFIX = "pool_"
POOL_ANSWER_SHAPE = "openai"


class Settle(StrEnum):
    """Who settles an admitted request (the route it takes turns on the response filter it needs)."""

    ACCESS_LOG = "als"  # a JSON answer: its usage reaches the access log through json_to_metadata
    METERED = "metered"  # an idempotent JSON answer: the meter records it for replay, then settles
    STREAM = "stream"  # a stream: the Lua stream guard in Envoy, settled from the access log
    KEPT_STREAM = "kept_stream"  # an idempotent stream: the ext_proc stream guard records it for replay
    # An answer checked after generation (extproc/answer_checks.py): the meter holds a JSON answer whole
    # (its headers too, so a failing one can still become a 502), the ext_proc stream guard a stream's
    # tool calls; both fail closed, and keep the answer for replay when the request is idempotent.
    CHECKED = "checked"
    CHECKED_STREAM = "checked_stream"
    # The decision answered the request itself (a refusal after it reserved, the route's degraded answer):
    # its worker releases the reservation; the access log settles it only as the backstop, the same way.
    DECIDED = "decided"


class StreamEnd(StrEnum):
    """How the Lua stream guard saw a stream end (Key.STREAM_END)."""

    DONE = "done"
    MALFORMED = "malformed"
    ERROR = "error"
    OVERSIZED = "oversized"
    UNFINISHED = "unfinished"
    OVER = "over"  # past its end time (max_stream_ms)


# What the attempt filter asks for: the host's cluster, the decision's plan, losses and trace.
ATTEMPT_ATTRIBUTES = (HOST_CLUSTER, metadata_path(Key.PLAN), metadata_path(Key.LOSSES),
                      metadata_path(Key.PLAN_STREAM), metadata_path(Key.TRACE), metadata_path(Key.HOLD),
                      "request.id")
# The internal usage object's counts, each by the io.llmgw metadata key it travels under from Envoy's
# filters to settlement (json_to_metadata for a JSON answer, the Lua stream guard for a stream) and its
# path in the usage object. The classes priced apart are there only when the upstream reported them.
USAGE_COUNTS: tuple[tuple[Key, tuple[str, ...]], ...] = (
    (Key.USAGE_PROMPT, ("prompt_tokens",)), (Key.USAGE_COMPLETION, ("completion_tokens",)),
    (Key.USAGE_CACHED, ("prompt_tokens_details", "cached_tokens")),
    (Key.USAGE_CACHE_WRITE, ("prompt_tokens_details", "cache_write_tokens")),
    (Key.USAGE_CACHE_WRITE_1H, ("prompt_tokens_details", "cache_write_1h_tokens")),
    (Key.USAGE_REASONING, ("completion_tokens_details", "reasoning_tokens")))
PRICED_APART = (Key.USAGE_CACHE_WRITE, Key.USAGE_CACHE_WRITE_1H, Key.USAGE_REASONING)
# The ledger's marks of how a request was served (the route's degraded answer, a canary's side of the
# answer, the shadow candidate the request was copied to, a token count and the shape that counted,
# the candidates left out and why, how admission let it through).
LEDGER_MARKS = (Key.DEGRADED, Key.CANARY, Key.SHADOW, Key.COUNT, Key.DISQUALIFIED, Key.ADMISSION)
# What the meter asks for at the answer's end.
METER_ATTRIBUTES = ("request.id", "request.time", "upstream.address", "response.code",
                    f"response.headers['{Header.DEPLOYMENT}']", ATTEMPT_COUNT,
                    *(metadata_path(k) for k in (Key.TENANT, Key.ROUTE, Key.REVISION, Key.TRACE, Key.DEPLOYMENT,
                                                 Key.REDACTIONS, Key.HOLD, Key.STREAM, Key.WITHHOLD_USAGE, Key.PLAN,
                                                 *LEDGER_MARKS, Key.STREAM_ENDS_AT_MS, Key.CHECKS, Key.DOOR,
                                                 Key.DECISION_ID, Key.UPSTREAM_STATUS, Key.NATIVE_FINISH_REASON,
                                                 Key.UPSTREAM_REQUEST_ID, Key.UPSTREAM_MODEL,
                                                 Key.TRANSLATION_LOSS, Key.UPSTREAM_MESSAGE)))
# The attempt filter's processing modes (Envoy's enum names): its own, for an attempt whose body is
# rewritten (another served model, another API shape: the request body comes through ext_proc, an
# answer body never does), and the one an attempt switches to when its body needs no rewrite (the
# renderer allows exactly this override).
ATTEMPT_WITHOUT_BODY = {"request_header_mode": "SEND", "request_body_mode": "NONE",
                        "response_header_mode": "SEND", "response_body_mode": "NONE",
                        "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
ATTEMPT_WITH_BODY = {**ATTEMPT_WITHOUT_BODY, "request_body_mode": "BUFFERED"}

# Wire values both sides keep: the largest event a stream may carry (else the stream is malformed), and
# the keep-alive comment that stands for an event withheld (a Lua filter reads an empty chunk as the
# stream's end, so never an empty one).
MAX_EVENT_BYTES = 1 << 20
KEEPALIVE = b":\n\n"

# Why a stream ended early, as its `stream_interrupted` event says it.
INTERRUPTED: dict[StreamEnd, str] = {
    StreamEnd.MALFORMED: "the upstream sent a malformed event",
    StreamEnd.ERROR: "the upstream reported an error mid-stream",
    StreamEnd.OVERSIZED: "the upstream sent an oversized event",
    StreamEnd.UNFINISHED: "the upstream ended the stream without finishing it",
    StreamEnd.OVER: "the stream reached the route's maximum duration (max_stream_ms)",
}
