"""The Anthropic front door: `POST /v1/messages` as the Messages API takes it, so the `anthropic` SDK
with its base URL at the gateway works unchanged.

Request: checked against the Messages API's shape (pydantic, strict about what it does not know:
a field the gateway cannot carry is 400 `unsupported_field` naming it, never dropped) and turned into
the internal contract (extproc/shapes/anthropic/adapter.py internal_body: system hoisted into a message,
content blocks, tool_use/tool_result, stop_sequences, tool_choice); from there every stage runs as for
a chat completion. A stream always asks for usage: Anthropic's events carry it.

Answer (the internal chat completion -> a Message): text and tool_use blocks, the stop reason
(`end_turn`, `stop_sequence` with the string, `max_tokens`, `tool_use`, `refusal`), usage with the
prefix-cache hits as `cache_read_input_tokens`. Stream: the internal SSE chunks -> `message_start`,
`content_block_start` / `_delta` (`text_delta`, `input_json_delta`) / `_stop` per block, `message_delta`
with the stop reason and usage, `message_stop`; the contract's `stream_interrupted` becomes an
`error` event. Errors: Anthropic's body (`{"type": "error", "error": {"type", "message"}}`) with the
contract's code inside (`error.code`), the status unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from extproc import chat
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.anthropic.adapter import internal_body
from extproc.shapes.door import Door, StrictModel, validated
from extproc.shapes.loss import NATIVE

MESSAGES_PATH = "/v1/messages"
NAME = "anthropic"


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a provider's caching hint: the gateway's cache is its own


class ImageSource(StrictModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(StrictModel):
    """An earlier answer's reasoning, replayed with the provider's signature over it (a tool loop with
    thinking on replays it)."""
    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(StrictModel):
    # A system turn inside the conversation (Claude Code sends them): a system message where it stands.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(StrictModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(StrictModel):
    user_id: str | None = None


class Thinking(StrictModel):
    """Anthropic's own thinking switch: sent unchanged to a plan of Anthropic-shaped candidates only."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required when thinking is enabled")
        return self


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: OutputFormat | None = None
    # How much effort the model spends (thinking, tool calls, length): Anthropic's own, a hint.
    effort: Literal["low", "medium", "high", "max"] | None = None


class ContextEdit(StrictModel):
    """One of Anthropic's context-management edits (clearing old tool results or thinking): the
    provider's own, passed as it came; its parameters are the provider's to check."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ContextManagement(StrictModel):
    edits: list[ContextEdit] = []


class MessagesRequest(StrictModel):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None  # structured output: the internal json_schema response_format
    # Anthropic's own: sent unchanged to a plan of Anthropic-shaped candidates only (extproc/shapes/door.py).
    service_tier: Literal["auto", "standard_only"] | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None


# Anthropic's own fields that are hints (extproc/shapes/door.py Door.hints): to another shape's candidate
# they are dropped and reported.
HINTS = frozenset({"thinking", "output_config.effort", "context_management"})
OWN = ("service_tier", "thinking", "context_management")


class CountTokensRequest(StrictModel):
    """`POST /v1/messages/count_tokens`: what the prompt of a Messages request would count."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


def _validated(model: type[StrictModel], raw: bytes) -> Any:
    return validated(model, chat.parse_json(raw), "Messages API")


def request(raw: bytes) -> dict[str, Any]:
    """A Messages request as the internal chat completion request (GatewayError on bad input)."""
    native = _validated(MessagesRequest, raw)
    for i, turn in enumerate(native.messages):
        for j, block in enumerate(turn.content if isinstance(turn.content, list) else ()):
            if isinstance(block, RedactedThinkingBlock):
                raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, "a redacted_thinking block is not carried by this "
                                   "gateway's Messages API", f"messages.{i}.content.{j}")
    if native.thinking is not None and native.thinking.budget_tokens is not None \
            and native.thinking.budget_tokens >= native.max_tokens:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "max_tokens must be greater than thinking.budget_tokens",
                           "thinking.budget_tokens")
    body = internal_body(native.model_dump(exclude_none=True, by_alias=True, exclude=set(OWN)))
    own = native.model_dump(exclude_none=True, include=set(OWN))
    if native.output_config is not None and native.output_config.effort is not None:
        own["output_config.effort"] = native.output_config.effort
    if own:
        body[NATIVE] = own
    if native.tool_choice is not None and native.tool_choice.type == "tool" and not native.tool_choice.name:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "tool_choice.name is required for type tool", "tool_choice")
    if native.stream:
        body["stream_options"] = {"include_usage": True}  # the events carry usage: the client asked for it
    return body


def count_request(raw: bytes) -> dict[str, Any]:
    """A count_tokens request as the internal request whose prompt is counted (one token to generate:
    the contract asks for a bound, and counting generates nothing)."""
    native = _validated(CountTokensRequest, raw)
    return internal_body({**native.model_dump(exclude_none=True, by_alias=True), "max_tokens": 1})


# Internal request field -> the Messages API field it came from (those whose name differs).
FIELDS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
          "user": "metadata.user_id", "response_format": "output_config.format"}


# -- model lookups: GET /v1/models and /v1/models/{route} with `anthropic-version` (the SDK's models API) --

def model_object(route: str, input_limit: int, output_limit: int) -> dict[str, Any]:
    """A route as Anthropic's ModelInfo."""
    return {"type": "model", "id": route, "display_name": route, "created_at": "1970-01-01T00:00:00Z",
            "max_input_tokens": input_limit, "max_tokens": output_limit}


def model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"data": models, "has_more": False, "first_id": models[0]["id"] if models else None,
            "last_id": models[-1]["id"] if models else None}


# -- answers and errors: the tables the Lua door filter renders in (its Python twin: tests/oracles/) ----

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}  # else end_turn


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    err: dict[str, Any] = {"type": ERROR_TYPES.get(status, "api_error"), "message": message, "code": code}
    if param:
        err["param"] = param
    return json.dumps({"type": "error", "error": err}).encode()


def error(status: int, body: bytes) -> bytes:
    """A contract error (or any non-2xx body) in Anthropic's shape; one already in it is kept."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("type") == "error":
        return body
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return error_body(status, f"the gateway answered {status}", ErrorCode.UPSTREAM_ERROR.value)
    return error_body(status, str(err.get("message", "")), str(err.get("code", "")), err.get("param"))



DOOR = Door(NAME, re.escape(MESSAGES_PATH), lambda raw, _path: request(raw), error, ("x-api-key",),
            fields=FIELDS, model_object=model_object, model_list=model_list, models_header="anthropic-version",
            hints=HINTS, endpoints=(f"POST {MESSAGES_PATH}", f"POST {MESSAGES_PATH}/count_tokens"),
            count_path=re.escape(MESSAGES_PATH + "/count_tokens"), count_request=lambda raw, _path: count_request(raw))
