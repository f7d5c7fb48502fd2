"""The Responses front door: `POST /v1/responses` as OpenAI's Responses API takes it, so the openai
SDK's `responses.*`, Codex, the Agents SDK and the frameworks' Responses models work with their base
URL at the gateway.

Stateless: the gateway keeps no responses. A request is served when it carries its whole conversation
(`store` absent or false); `store: true`, `previous_response_id`, `conversation`, `background` and
item references are refused by name (400 `unsupported_field`), since serving them would need a store
of other tenants' conversations the gateway does not keep (docs/FIELDS.md).

Request: checked against the Responses shape (pydantic, strict about what it does not know) and
turned into the internal chat completion request: `instructions` and `system`/`developer` messages
as system turns; `input_text`/`output_text`/`input_image` parts; `function_call` items as the
assistant's tool calls and `function_call_output` items as tool turns; earlier `reasoning` items
dropped (the internal contract carries no reasoning back to a model; their encrypted content is the
provider's and none of this gateway's upstreams takes it); function tools, and a `namespace` of them
(Codex's `multi_agent_v1`) as functions named `namespace__function` inside the gateway (the tool
catalog sees that name; answers name the namespace and the function apart again, Key.NAMESPACES);
built-in tools (`web_search`, `file_search`, ...) are hints: no upstream here hosts them, so they are
dropped and reported (x-llmgw-translation-loss, the ledger), the model never told of them - unless
`tool_choice` demands one, which is refused by name; `text.format` as `response_format`; `reasoning.effort` as
`reasoning_effort`; `max_output_tokens` as `max_tokens`. From there every stage runs as for a chat
completion. A stream always asks for usage: `response.completed` carries it.

Answer (the internal chat completion -> a Response): output items in order - the reasoning (as a
summary), the message (`output_text`), each function call; `status` `completed`, or `incomplete` with
its reason (`max_output_tokens`, `content_filter`); usage with cached and reasoning tokens. Stream:
`response.created`, `response.in_progress`, each item's `output_item.added`, its deltas and `.done`
events, `response.completed` (or `response.incomplete`) with the whole response; every event numbered
(`sequence_number`). An interruption is `response.failed` carrying the contract's code. Errors are
OpenAI's shape already (the contract's). The translation of answers runs in Envoy
(extproc/shapes/openai/door.lua); its Python twin is tests/oracles/openai_door.py.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field

from extproc import chat
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.door import Door, StrictModel, validated
from extproc.shapes.loss import NAMESPACES, NATIVE

NAME = "responses"
PATH = "/v1/responses"
# What `include` may ask for: encrypted reasoning to replay (the gateway's upstreams return none, and a
# replayed reasoning item is dropped), so asking for it is harmless.
INCLUDABLE = frozenset({"reasoning.encrypted_content"})
STATELESS = ("this gateway keeps no responses: send `store: false` (or leave it out) and the whole "
             "conversation as `input`")


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    """An earlier answer's text, replayed as the SDK returned it."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(StrictModel):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputFile(StrictModel):
    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | OutputText | InputImage | InputFile | Refusal, Field(discriminator="type")]


class Message(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCall(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a function of a namespace tool
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Annotated[InputText | InputImage | InputFile, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None


class Reasoning(StrictModel):
    """An earlier answer's reasoning, replayed: dropped (see the module's docstring)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(v: Any) -> str:
    return str(v.get("type") or "message") if isinstance(v, dict) else "message"


ITEM_MODELS: dict[str, type[StrictModel]] = {"message": Message, "function_call": FunctionCall,
                                         "function_call_output": FunctionCallOutput, "reasoning": Reasoning}


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(StrictModel):
    type: Literal["namespace"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


# The separator of a namespace and its function's name inside the gateway: `_` and `-` are the only
# punctuation every provider's tool names allow.
NAMESPACE_SEP = "__"


def namespaced(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # How much of the reasoning to summarise: the gateway returns what the model reasoned, as it is.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainFormat(StrictModel):
    type: Literal["text", "json_object"]


class TextConfig(StrictModel):
    format: Annotated[JsonSchemaFormat | PlainFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # padding against length side channels: nothing to pad here


class ResponsesRequest(StrictModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    # (any other object names a built-in tool: refused by name below)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None  # the caller's tags: the ledger keeps them
    client_metadata: dict[str, Any] | None = None  # a client's own tags (Codex): not the model's concern
    prompt_cache_key: str | None = None  # the gateway's prompt cache is keyed per tenant (cache_salt)
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Refused by name below: they need a store of responses.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None


def _validated(model: type[StrictModel], doc: Any, at: tuple[Any, ...] = ()) -> Any:
    return validated(model, doc, "Responses API", at)


def _refuse(param: str, why: str) -> GatewayError:
    return GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{param}` is not served: {why}", param)


def _content(parts: str | list[Any], param: str) -> str:
    """A message's content as the internal contract's text: parts joined, an earlier answer's refusal
    as the text it was; an image is refused by name (no deployment here takes other inputs)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, p in enumerate(parts):
        if isinstance(p, (InputImage, InputFile)):
            raise _refuse(f"{param}.{j}", "no deployment behind this gateway takes images or files")
        texts.append(p.refusal if isinstance(p, Refusal) else p.text)
    return "".join(texts)


def _messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Input items as the internal messages: consecutive function calls are one assistant turn (joined
    to the assistant's text just before them), each output a tool turn."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for i, raw in enumerate(items):
        kind = _item_kind(raw)
        if kind == "item_reference":
            raise _refuse(f"input.{i}", "an item reference names a stored response; " + STATELESS)
        model = ITEM_MODELS.get(kind)
        if model is None:
            raise _refuse(f"input.{i}.type", f"`{kind}` items are not carried by this gateway's Responses API")
        item = _validated(model, raw, ("input", i))
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content, f"input.{i}.content")})
        elif isinstance(item, FunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": namespaced(item.namespace, item.name), "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutput):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(item.output, f"input.{i}.output")})
        # a Reasoning item: dropped
    return out


def _function(tool: FunctionTool, namespace: str | None = None) -> dict[str, Any]:
    fn = tool.model_dump(exclude_none=True, exclude={"type"})
    fn["name"] = namespaced(namespace, tool.name)
    return {"type": "function", "function": fn}


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """The function tools (a namespace's flattened), the namespaces, and the built-in tools by where
    the caller wrote them (`tools.8`), which the route drops and reports."""
    out, namespaces, builtin = [], [], {}
    for i, raw in enumerate(tools):
        kind = str(raw.get("type", "")) if isinstance(raw, dict) else ""
        if kind == "function":
            out.append(_function(_validated(FunctionTool, raw, ("tools", i))))
        elif kind == "namespace":
            ns = _validated(NamespaceTool, raw, ("tools", i))
            namespaces.append(ns.name)
            out.extend(_function(t, ns.name) for t in ns.tools)
        elif kind:
            builtin[f"tools.{i}"] = kind
        else:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"tools.{i}: a tool needs its `type`", f"tools.{i}")
    return out, namespaces, builtin


def request(raw: bytes) -> dict[str, Any]:
    """A Responses request as the internal chat completion request (GatewayError on bad input)."""
    native: ResponsesRequest = _validated(ResponsesRequest, chat.parse_json(raw))
    if native.store:
        raise _refuse("store", STATELESS)
    for name in ("previous_response_id", "conversation"):
        if getattr(native, name) is not None:
            raise _refuse(name, STATELESS)
    if native.background:
        raise _refuse("background", "a response is answered while its request waits")
    if native.truncation == "auto":
        raise _refuse("truncation", "the gateway never drops a caller's turns (`disabled` is accepted)")
    for j, extra in enumerate(native.include or ()):
        if extra not in INCLUDABLE:
            raise _refuse(f"include.{j}", f"`{extra}` is not produced by this gateway")
    items = [{"role": "user", "content": native.input}] if isinstance(native.input, str) else native.input
    body: dict[str, Any] = {"model": native.model, "messages": _messages(items, native.instructions)}
    if not body["messages"]:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "`input` holds no message", "input")
    if native.tools:
        tools, namespaces, builtin = _tools(native.tools)
        if tools:
            body["tools"] = tools
        if namespaces:
            body[NAMESPACES] = namespaces
        if builtin:
            body[NATIVE] = builtin
    if isinstance(native.tool_choice, dict):
        raise _refuse("tool_choice", f"it demands the built-in tool `{native.tool_choice.get('type')}`, which no "
                      "upstream behind this gateway hosts")
    if isinstance(native.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": native.tool_choice.name}}
    elif native.tool_choice is not None:
        body["tool_choice"] = native.tool_choice
    # The same fields in both APIs; the ones the gateway answers itself (store, metadata, the cache key,
    # the tier, the end user's identifier) are taken at intake as for any chat completion (client_fields.py).
    same = {"parallel_tool_calls", "temperature", "top_p", "store", "metadata", "prompt_cache_key",
            "service_tier", "user", "safety_identifier"}
    body.update(native.model_dump(exclude_none=True, include=same))
    if native.max_output_tokens is not None:
        body["max_tokens"] = native.max_output_tokens
    if native.reasoning is not None and native.reasoning.effort is not None:
        body["reasoning_effort"] = native.reasoning.effort
    if native.text is not None:
        if native.text.verbosity is not None:
            body["verbosity"] = native.text.verbosity
        fmt = native.text.format
        if isinstance(fmt, JsonSchemaFormat):
            schema = fmt.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
    if native.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return body


# Internal request field -> the Responses field it came from (those whose name differs).
FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "verbosity": "text.verbosity",
          "reasoning_effort": "reasoning.effort", "messages": "input"}


# -- answers and errors: the tables the Lua door filter renders in (its Python twin: tests/oracles/) ----

# A chat completion's finish -> the Response's incomplete reason (any other finish: completed).
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"),
                                 "param": param, "code": code}}).encode()


def error(status: int, body: bytes) -> bytes:
    """A contract error (or any non-2xx body) in OpenAI's shape: the contract's own is kept."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return body
    return error_body(status, f"the gateway answered {status}", ErrorCode.UPSTREAM_ERROR.value)


# Built-in tools (`tools.N`) are hints: dropped and reported wherever they would go (no upstream here hosts them).
DOOR = Door(NAME, re.escape(PATH), lambda raw, _path: request(raw), error, fields=FIELDS, hints=frozenset({"tools"}),
            endpoints=(f"POST {PATH}",))
