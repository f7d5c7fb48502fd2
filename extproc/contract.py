"""The external contract's fixed names: error codes, headers, metadata keys (docs/guide/clients.md,
docs/ARCHITECTURE.md).

One error tree: every refusal the gateway produces is a `GatewayError` carrying one `ErrorCode`, whose
value is the contract's `code` and doubles as the metric label.
"""

from __future__ import annotations

import json
from enum import StrEnum

import orjson

METADATA_NAMESPACE = "io.llmgw"
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
MODELS_PATH = "/v1/models"  # and /v1/models/{route}
# Each worker's status server answers it from the loop that decides requests (Envoy's health check).
WORKER_HEALTH_PATH = "/healthz"
REVISION_HEADER = "x-llmgw-route-revision"  # on every answer, Envoy's own included
DECISION_ID_HEADER = "x-llmgw-decision-id"  # on a refusal made after the authorization decision
ROLE_KEY = "x-llmgw-role"  # gRPC metadata on each ext_proc filter's stream: which handler takes it
# On every error: whether a client's own retry can change the outcome. The openai and anthropic SDKs obey
# it before their own rules (which retry 408, 409, 429 and every 5xx, twice by default).
SHOULD_RETRY_HEADER = "x-should-retry"
RETRY_AFTER_HEADER = "retry-after"


class Role(StrEnum):
    """The ext_proc filters besides the decision filter (which sends no role)."""

    ATTEMPT = "attempt"  # upstream filter of a fallback route, once per attempt
    STREAMS = "streams"  # the stream guard: every chunk of a streamed answer
    METER = "meter"  # idempotent JSON answers: recorded for replay before the client has them


class ErrorCode(StrEnum):
    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_FIELD = "unsupported_field"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    ROUTE_NOT_FOUND = "route_not_found"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
    # The key's request ended without a known outcome (it may have run): not run again until an operator
    # resolves the key (`llmgw ledger resolve`).
    IDEMPOTENCY_AMBIGUOUS = "idempotency_ambiguous"
    BUDGET_EXHAUSTED = "budget_exhausted"
    RATE_LIMITED = "rate_limited"
    CONCURRENCY_LIMITED = "concurrency_limited"
    # The gateway refuses what its capacity cannot take in time: a saturated pool past the class's queue
    # TTL, or a provider quota spent (extproc/admission.py); Retry-After says when to come back.
    OVERLOADED = "overloaded"
    UPSTREAM_ERROR = "upstream_error"
    NO_QUALIFIED_ROUTE = "no_qualified_route"
    POLICY_UNAVAILABLE = "policy_unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    STREAM_INTERRUPTED = "stream_interrupted"
    ANSWER_REJECTED = "answer_rejected"  # the upstream's answer failed the gateway's checks (answer_checks.py)

    @property
    def status(self) -> int:
        return _STATUS[self]

    @property
    def error_type(self) -> str:
        """OpenAI-style `type`: what SDKs show beside the code."""
        s = self.status
        if s == 401:
            return "authentication_error"
        if s == 403:
            return "permission_error"
        if s == 404:
            return "not_found_error"
        if s == 429:
            return "rate_limit_error"
        return "invalid_request_error" if s < 500 else "server_error"


_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNSUPPORTED_FIELD: 400,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.ROUTE_NOT_FOUND: 404,
    ErrorCode.IDEMPOTENCY_CONFLICT: 409,
    ErrorCode.IDEMPOTENCY_KEY_REUSED: 422,
    ErrorCode.IDEMPOTENCY_AMBIGUOUS: 409,
    ErrorCode.BUDGET_EXHAUSTED: 429,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.CONCURRENCY_LIMITED: 429,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.UPSTREAM_ERROR: 502,
    ErrorCode.NO_QUALIFIED_ROUTE: 503,
    ErrorCode.POLICY_UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.STREAM_INTERRUPTED: 502,
    ErrorCode.ANSWER_REJECTED: 502,
}


# The refusals a retry may turn into an answer, and how many seconds to wait when the refusal names no
# time itself: capacity that frees (a quota's window, the tenant's in-flight cap, a pool's queue) and the
# gateway's own dependencies (the store, the policy). Every other error is final for the request as
# sent: the gateway has already retried what its route allows, and a refusal that depends on the
# request, its caller or the configuration is the same refusal again - while each retry an SDK sends
# on its own is generated and charged again.
RETRY_LATER_S: dict[ErrorCode, int] = {
    ErrorCode.RATE_LIMITED: 1,
    ErrorCode.CONCURRENCY_LIMITED: 1,
    ErrorCode.OVERLOADED: 1,
    ErrorCode.POLICY_UNAVAILABLE: 1,
}


def retry_advice(code: ErrorCode, retry_after: str = "") -> dict[str, str]:
    """The headers that tell a client whether to retry this error: `retry-after` (the refusal's own, or
    the code's default) with `x-should-retry: true` when a retry may succeed later, else `false`. A
    refusal that names a time to come back (an Idempotency-Key still in flight) may retry whatever its code."""
    retry_after = retry_after or (str(RETRY_LATER_S[code]) if code in RETRY_LATER_S else "")
    if retry_after:
        return {RETRY_AFTER_HEADER: retry_after, SHOULD_RETRY_HEADER: "true"}
    return {SHOULD_RETRY_HEADER: "false"}


class GatewayError(Exception):
    """A refusal that ends the exchange with the contract's JSON error."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return self.code.status

    def response_headers(self) -> dict[str, str]:
        """The refusal's own headers with the retry advice (retry_advice)."""
        return {**self.headers, **retry_advice(self.code, self.headers.get(RETRY_AFTER_HEADER, ""))}

    def body(self, decision_id: str = "") -> bytes:
        return error_body(self.code, self.message, self.param, decision_id)


def error_body(code: ErrorCode, message: str, param: str | None = None, decision_id: str = "") -> bytes:
    """The contract's error (its four names are fixed). A refusal made after the authorization
    decision names that decision at the end of the message, the key that joins it to the access log,
    the ledger and the decision log; the `x-llmgw-decision-id` header carries it too."""
    if decision_id:
        message = f"{message} (decision_id {decision_id})"
    return json.dumps({"error": {"message": message, "type": code.error_type, "code": code.value,
                                 "param": param}}).encode()


def degraded_body(route: str, text: str, request_id: str, created: int, stream: bool, usage_chunk: bool) -> bytes:
    """A route's fixed degraded answer as a completed chat completion (SSE when `stream`), with no
    usage: nothing upstream ran. Also what Envoy answers when every upstream was down
    (llmgw/render/errors.py renders it with Envoy's request id)."""
    base = {"id": f"chatcmpl-degraded-{request_id}", "created": created, "model": route}
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    if not stream:
        return orjson.dumps({**base, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
    chunk = {**base, "object": "chat.completion.chunk"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                     "finish_reason": None}]},
              {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    if usage_chunk:
        events.append({**chunk, "choices": [], "usage": usage})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def interrupted_event(message: str) -> bytes:
    """A stream's `stream_interrupted` event, as the contract writes it (ext_proc and the Lua filters)."""
    return b"data: " + error_body(ErrorCode.STREAM_INTERRUPTED, message) + b"\n\n"
