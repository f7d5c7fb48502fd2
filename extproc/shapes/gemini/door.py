"""The Gemini front door: `POST /v1beta/models/{route}:generateContent` and
`:streamGenerateContent?alt=sse` (and the same under `/v1/` and `/v1alpha/`), as the Gemini API takes
them (the google-genai SDK, or plain HTTP).

Request: the route is the path's model; the body is checked against generateContent's shape
(pydantic, strict: `safetySettings`, `cachedContent` and tools other than function declarations are
400 `unsupported_field` naming them; integer fields take whole numbers written as 5.0, as proto3 JSON
does; Gemini's OpenAPI-subset `Schema` in `parameters` and `responseSchema` becomes JSON Schema) and
turned into the internal chat completion (extproc/shapes/gemini/adapter.py internal_body). A stream
must ask for SSE (`alt=sse`).

Answer: the internal chat completion -> `candidates` (text and whole `functionCall` parts, one per
choice), `finishReason` (STOP, MAX_TOKENS, SAFETY), `usageMetadata` (cached tokens as
`cachedContentTokenCount`). Stream: one response per internal chunk with text; function calls, the
finish reason and usage in the last one (Gemini sends calls whole); no `[DONE]`; the contract's
`stream_interrupted` becomes an error response. Errors: Google's body (`{"error": {"code", "message",
"status", "details"}}`), the contract's code as the `reason` of an ErrorInfo detail.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, unquote

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from extproc import chat
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.door import Door, null_is_absent, path_of, query_of
from extproc.shapes.gemini.adapter import internal_body
from extproc.shapes.gemini.schema import Schema, either
from extproc.shapes.loss import NATIVE

NAME = "gemini"
# Every API version the SDKs address: google-genai asks v1beta by default, `api_version="v1"` (or
# "v1alpha") when its user says so; the door's contract is the same on each.
PATH = re.compile(r"/(?:v1|v1beta|v1alpha)/models/([^/:]+):(generateContent|streamGenerateContent)")
PATH_REGEX = PATH.pattern  # for Envoy's routes (RE2 takes it as it is)


class _Strict(BaseModel):
    # The API's JSON takes each field as lowerCamelCase or as its proto name (snake_case): the SDKs
    # send both (google-genai sends `parameters_json_schema`).
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, alias_generator=to_camel)
    _null_is_absent = model_validator(mode="before")(null_is_absent)


class Blob(_Strict):
    mime_type: str
    data: str


class FileData(_Strict):
    file_uri: str
    mime_type: str | None = None


class FunctionCall(_Strict):
    name: str
    args: dict[str, Any] = {}
    id: str | None = None


class FunctionResponse(_Strict):
    name: str
    response: dict[str, Any]
    id: str | None = None


class Part(_Strict):
    text: str | None = None
    inline_data: Blob | None = None
    file_data: FileData | None = None
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None
    thought: bool | None = None
    thought_signature: str | None = None

    @model_validator(mode="after")
    def _one(self) -> Part:
        kinds = [k for k in ("text", "inline_data", "file_data", "function_call", "function_response")
                 if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("a part holds exactly one of text, inlineData, fileData, functionCall, functionResponse")
        return self


class Content(_Strict):
    role: Literal["user", "model"] = "user"
    parts: list[Part] = Field(min_length=1)


class SystemInstruction(_Strict):
    role: str | None = None
    parts: list[Part] = Field(min_length=1)


def _whole(value: Any) -> Any:
    """An integer field as proto3 JSON takes it: a number with no fraction (google-genai sends `topK`
    as 5.0); 5.5 stays a float and is refused as not an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Whole = Annotated[int, BeforeValidator(_whole)]


class FunctionDeclaration(_Strict):
    name: str
    description: str | None = None
    # The parameters as JSON Schema, or as Gemini's OpenAPI-subset Schema (what the SDK sends for a
    # Python function and for types.Schema): converted to JSON Schema (extproc/shapes/gemini/schema.py).
    parameters_json_schema: dict[str, Any] | None = None
    parameters: Schema | None = None
    # What the function returns: advice to the model that the chat contract has no place for; the
    # function's actual result, in the next turn's functionResponse, is carried. Accepted, not sent.
    response: Schema | None = None
    response_json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_schema(self) -> FunctionDeclaration:
        self.parameters_json_schema = either(self.parameters, self.parameters_json_schema,
                                             "parameters or parametersJsonSchema")
        self.parameters = self.response = self.response_json_schema = None
        return self


class Tool(_Strict):
    function_declarations: list[FunctionDeclaration]


class FunctionCallingConfig(_Strict):
    mode: Literal["AUTO", "ANY", "NONE", "VALIDATED"] = "AUTO"
    allowed_function_names: list[str] | None = None


class ToolConfig(_Strict):
    function_calling_config: FunctionCallingConfig


class ThinkingConfig(_Strict):
    """Gemini's own thinking switch (generationConfig.thinkingConfig): a budget or a level, and whether
    the answer shows the thoughts. Sent unchanged to a plan of Gemini-shaped candidates only."""
    include_thoughts: bool | None = None
    thinking_budget: Whole | None = Field(default=None, ge=-1)  # -1: the model decides; 0: off
    thinking_level: Literal["THINKING_LEVEL_UNSPECIFIED", "MINIMAL", "LOW", "MEDIUM", "HIGH"] | None = None


class GenerationConfig(_Strict):
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Whole | None = Field(default=None, ge=1)
    candidate_count: Whole | None = Field(default=None, ge=1)
    max_output_tokens: Whole | None = Field(default=None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Whole | None = None
    response_mime_type: Literal["text/plain", "application/json"] | None = None
    # The answer's shape as JSON Schema, or as Gemini's Schema (the SDK's `response_schema=` with a
    # pydantic class or types.Schema), converted like a function's parameters.
    response_json_schema: dict[str, Any] | None = None
    response_schema: Schema | None = None
    thinking_config: ThinkingConfig | None = None  # Gemini's own (extproc/shapes/door.py): never translated

    @model_validator(mode="after")
    def _one_schema(self) -> GenerationConfig:
        self.response_json_schema = either(self.response_schema, self.response_json_schema,
                                           "responseSchema or responseJsonSchema")
        self.response_schema = None
        if self.response_json_schema is not None and self.response_mime_type != "application/json":
            raise ValueError("a response schema needs responseMimeType application/json")
        return self


class SafetySetting(_Strict):
    category: str = Field(pattern=r"^HARM_CATEGORY_[A-Z_]+$")
    threshold: str = Field(pattern=r"^(BLOCK_[A-Z_]+|HARM_BLOCK_THRESHOLD_UNSPECIFIED|OFF)$")
    method: Literal["SEVERITY", "PROBABILITY", "HARM_BLOCK_METHOD_UNSPECIFIED"] | None = None


class GenerateContentRequest(_Strict):
    contents: list[Content] = Field(min_length=1)
    # Gemini's own: sent unchanged to a plan of Gemini-shaped candidates only (extproc/shapes/door.py).
    safety_settings: list[SafetySetting] | None = None
    system_instruction: SystemInstruction | None = None
    generation_config: GenerationConfig | None = None
    tools: list[Tool] | None = None
    tool_config: ToolConfig | None = None


class NamedGenerateContentRequest(GenerateContentRequest):
    model: str | None = None  # `models/{model}`: the path names the route


class CountTokensRequest(_Strict):
    """`POST .../models/{route}:countTokens`: the contents alone, or a whole generateContent request."""

    contents: list[Content] | None = None
    generate_content_request: NamedGenerateContentRequest | None = None

    @model_validator(mode="after")
    def _one(self) -> CountTokensRequest:
        if (self.contents is None) == (self.generate_content_request is None):
            raise ValueError("countTokens takes contents or generateContentRequest (one of them)")
        return self


COUNT_PATH = re.compile(r"/(?:v1|v1beta|v1alpha)/models/([^/:]+):countTokens")


def route_of(path: str) -> tuple[str, bool] | None:
    """(the route named in the path, whether it streams), or None for another path."""
    m = PATH.fullmatch(path_of(path))
    return (unquote(m.group(1)), m.group(2) == "streamGenerateContent") if m else None


def request(raw: bytes, path: str) -> dict[str, Any]:
    """A generateContent request as the internal chat completion request (GatewayError on bad input)."""
    where = route_of(path)
    if where is None:
        raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, "no such endpoint")
    route, stream = where
    if stream and parse_qs(query_of(path)).get("alt") != ["sse"]:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "streamGenerateContent takes alt=sse (server-sent events)", "alt")
    native = _validated(GenerateContentRequest, raw)
    config = native.generation_config
    thinking = config.thinking_config if config is not None else None
    if config is not None:
        config.thinking_config = None
    body = internal_body(native.model_dump(exclude_none=True, by_alias=True), route, stream)
    own: dict[str, Any] = {}
    if native.safety_settings:
        own["safetySettings"] = [s.model_dump(exclude_none=True, by_alias=True) for s in native.safety_settings]
    if thinking is not None:
        own["generationConfig.thinkingConfig"] = thinking.model_dump(exclude_none=True, by_alias=True)
    if own:
        body[NATIVE] = own
    if stream:
        body["stream_options"] = {"include_usage": True}  # the last response carries usage
    return body


def count_request(raw: bytes, path: str) -> dict[str, Any]:
    """A countTokens request as the internal request whose prompt is counted (one token to generate:
    the contract asks for a bound, and counting generates nothing)."""
    m = COUNT_PATH.fullmatch(path_of(path))
    if m is None:
        raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, "no such endpoint")
    native = _validated(CountTokensRequest, raw)
    doc = (native.generate_content_request.model_dump(exclude_none=True, by_alias=True, exclude={"model"})
           if native.generate_content_request is not None
           else {"contents": [c.model_dump(exclude_none=True, by_alias=True) for c in native.contents or ()]})
    body = internal_body(doc, unquote(m.group(1)))
    body["max_tokens"] = 1
    return body


def _validated(model: type[_Strict], raw: bytes) -> Any:
    doc = chat.parse_json(raw)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        # A field the gateway does not carry is named first: it is why the rest does not fit either.
        err = next((x for x in e.errors() if x["type"] == "extra_forbidden"), e.errors()[0])
        param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p[:1].isupper()))
        if err["type"] == "extra_forbidden":
            raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{param}` is not carried by this gateway's Gemini API",
                               param) from None
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{param}: {err['msg']}", param or None) from None


# Internal request field -> the generateContent field it came from.
FIELDS = {"max_tokens": "generationConfig.maxOutputTokens", "stop": "generationConfig.stopSequences",
          "temperature": "generationConfig.temperature", "top_p": "generationConfig.topP",
          "top_k": "generationConfig.topK", "seed": "generationConfig.seed", "n": "generationConfig.candidateCount",
          "presence_penalty": "generationConfig.presencePenalty",
          "frequency_penalty": "generationConfig.frequencyPenalty",
          "response_format": "generationConfig.responseMimeType",
          "tool_choice": "toolConfig.functionCallingConfig", "tools": "tools.functionDeclarations",
          "stream": "streamGenerateContent", "stream_options": "streamGenerateContent"}


# -- model lookups: GET /{version}/models and /{version}/models/{route} (google-genai's models.get/list) ----

# Its own versions' paths (under /v1/, shared with OpenAI's, the SDK's key header says it is Gemini's).
MODELS_PATH = re.compile(r"/(?:v1beta|v1alpha)/models(?:/([^/:]+))?/?")


def model_object(route: str, input_limit: int, output_limit: int) -> dict[str, Any]:
    """A route as Gemini's Model resource."""
    return {"name": f"models/{route}", "displayName": route, "description": f"the gateway's route {route}",
            "inputTokenLimit": input_limit, "outputTokenLimit": output_limit,
            "supportedGenerationMethods": ["generateContent", "streamGenerateContent"]}


def model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"models": models}


# -- answers and errors: the tables the Lua door filter renders in (its Python twin: tests/oracles/) ----

FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "content_filter": "SAFETY"}


STATUSES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
            408: "DEADLINE_EXCEEDED", 409: "ABORTED", 413: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT",
            429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 502: "UNAVAILABLE", 503: "UNAVAILABLE",
            504: "DEADLINE_EXCEEDED"}


def error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"code": status, "message": message, "status": STATUSES.get(status, "UNKNOWN"),
                                 "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                              "reason": code, "domain": "llmgw"}]}}).encode()


def error(status: int, body: bytes) -> bytes:
    """A contract error (or any non-2xx body) in Google's shape; one already in it is kept."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and "status" in err:
        return body
    if not isinstance(err, dict):
        return error_body(status, f"the gateway answered {status}", ErrorCode.UPSTREAM_ERROR.value)
    return error_body(status, str(err.get("message", "")), str(err.get("code", "")))



DOOR = Door(NAME, PATH_REGEX, request, error, ("x-goog-api-key",), "key", fields=FIELDS,
            model_object=model_object, model_list=model_list, models_path=MODELS_PATH.pattern,
            models_header="x-goog-api-key", count_path=COUNT_PATH.pattern, count_request=count_request,
            hints=frozenset({"generationConfig.thinkingConfig"}),  # Gemini CLI sends includeThoughts always
            endpoints=(*(f"POST /v1beta/models/{{model}}:{method}"
                         for method in ("generateContent", "streamGenerateContent", "countTokens")),
                       "GET /v1beta/models"))
