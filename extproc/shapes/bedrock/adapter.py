"""The `bedrock` adapter: Amazon Bedrock's Converse API (`POST /model/{modelId}/converse`, streams at
`/model/{modelId}/converse-stream`), signed with AWS Signature Version 4.

Request (internal -> Converse): system and developer messages become `system` text blocks; turns
become `messages` with roles `user` and `assistant` (consecutive turns of one role merge, as the API
wants them alternating); text becomes content blocks; an assistant's `tool_calls` become `toolUse`
blocks (input as an object) and `tool` messages `toolResult` blocks of a user turn; tools become
`toolConfig.tools[].toolSpec` with `inputSchema.json`, `tool_choice` `toolChoice` (`auto`, `any`,
`tool`); `max_tokens`, `temperature`, `top_p` and `stop` go into `inferenceConfig`, `top_k` into
`additionalModelRequestFields` (the model family's own field), `user` into `requestMetadata`. A
`response_format` JSON schema (its root an object) becomes a tool of its own, OUTPUT_TOOL, whose input
schema it is, and the model must call a tool: that one alone (`toolChoice.tool`), or, beside the
caller's tools, any (`toolChoice.any`, unless the caller named one). Converse has no other way to ask
for a schema; the answer's call of OUTPUT_TOOL is its content.

Signing: the credential reference resolves to `ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN]`; the
request is signed for the service `bedrock` in the deployment's `region` (adapter option) and its
`host` (option; default `bedrock-runtime.{region}.amazonaws.com`, which the attempt filter also sets as
the request's authority) with botocore's SigV4 signer, once the body is known (the signature covers
its hash). Signing happens in the attempt filter, not in Envoy's `aws_request_signing` filter: that one
would sign every attempt of a composite cluster (a pool attempt too) with one credential for the
whole Envoy, where here each deployment has its own credential reference, resolved like the others.

Answer and stream (Converse -> internal): text blocks join into `content`, `toolUse` blocks become
`tool_calls` (OUTPUT_TOOL's input becomes `content`, the answer's JSON, and its `tool_use` stop
`stop`), `reasoningContent` becomes `reasoning`; `stopReason` maps to `finish_reason`
(`guardrail_intervened` and `content_filtered` are `content_filter`). Converse answers carry no id or
model: the id is made here. Usage: `inputTokens` counts what was not read from or written to the
prompt cache, so the internal input is the sum of the three (cache reads as cached). The stream is
AWS event-stream framing (binary messages with CRCs, decoded by botocore's parser), not SSE:
`messageStart`, `contentBlockStart` (tool calls only), `contentBlockDelta` (text, a piece of a tool's
input JSON, reasoning), `contentBlockStop`, `messageStop`, and `metadata` with the usage last; an
exception message (`throttlingException`, `modelStreamErrorException`, ...) or a stream that ends
before its metadata is broken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import orjson

from extproc.shapes.base import (
    NativeRequest,
    Target,
    settings_back,
)
from extproc.shapes.loss import CACHE_CONTROL, Conditional, LossTable, Support, content_hint, losses

SERVICE = "bedrock"
S = Support


# The tool a `response_format` schema is asked for by (the Lua answer filter knows the name: a call of
# it is the answer's content). A caller's tool of this name would be read as the answer.
OUTPUT_TOOL = "llmgw_json_output"


def _output_schema(response_format: Any) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks the answer to follow, when Converse can carry it: a
    json_schema whose root is an object (a tool's input is one)."""
    if not isinstance(response_format, dict) or response_format.get("type") != "json_schema":
        return None
    schema = (response_format.get("json_schema") or {}).get("schema")
    return schema if isinstance(schema, dict) and schema.get("type") == "object" else None


def _over_one(v: Any) -> bool:
    return isinstance(v, (int, float)) and v > 1


LOSS_TABLE: LossTable = {
    "stream": S.SUPPORTED,  # the converse-stream path
    "stream_options": S.EMULATED,  # usage arrives in the metadata event; the chunk is built here
    "max_tokens": S.TRANSFORMED,  # inferenceConfig.maxTokens
    "max_completion_tokens": S.TRANSFORMED,
    "temperature": Conditional(_over_one, "above 1 (clamped to 1, the API's range)", otherwise=S.TRANSFORMED,
                               loss=S.TRANSFORMED),
    "top_p": S.TRANSFORMED,
    "top_k": S.TRANSFORMED,  # additionalModelRequestFields.top_k: the model family's own field
    "stop": S.TRANSFORMED,  # inferenceConfig.stopSequences
    "tools": S.TRANSFORMED,  # toolConfig.tools[].toolSpec
    "tool_choice": Conditional(lambda v: v == "none", "none (Converse cannot forbid the tools it is given)",
                               otherwise=S.TRANSFORMED),
    "parallel_tool_calls": S.UNSUPPORTED,  # false: Converse has no switch for it
    "user": S.TRANSFORMED,  # requestMetadata.user
    "cache_salt": S.EMULATED,  # the provider's cache is per account: no tenant salt to send
    "n": Conditional(lambda v: v != 1, "above 1 (one answer per request)"),
    "seed": S.UNSUPPORTED,
    "frequency_penalty": S.UNSUPPORTED,
    "presence_penalty": S.UNSUPPORTED,
    "logit_bias": S.UNSUPPORTED,
    "logprobs": S.UNSUPPORTED,
    "top_logprobs": S.UNSUPPORTED,
    "response_format": Conditional(lambda v: _output_schema(v) is None,
                                   "other than a json_schema whose root is an object (carried as a forced tool)",
                                   otherwise=S.TRANSFORMED),
    # a reasoning model's thinking switch: the provider's own (thinking, thinkingConfig) has another
    # meaning and range, not carried from this one
    "reasoning_effort": S.UNSUPPORTED,
    "verbosity": S.UNSUPPORTED,
    "min_p": S.UNSUPPORTED,
    "repetition_penalty": S.UNSUPPORTED,
    "min_tokens": S.UNSUPPORTED,
    "ignore_eos": S.UNSUPPORTED,
    "skip_special_tokens": S.UNSUPPORTED,
    "spaces_between_special_tokens": S.UNSUPPORTED,
    "include_stop_str_in_output": S.UNSUPPORTED,
    CACHE_CONTROL: S.TRANSFORMED,  # a cachePoint block after the part, system text or tool it marks
}

STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                "guardrail_intervened": "content_filter", "content_filtered": "content_filter",
                "model_context_window_exceeded": "length"}
INFERENCE = {"temperature": "temperature", "top_p": "topP"}


# -- request ----------------------------------------------------------------------------------------

def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict) and p.get("type") == "text")


CACHE_POINT = {"cachePoint": {"type": "default"}}  # Converse's caching breakpoint: the prompt up to here


def _blocks(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    # Text parts only: the contract refuses image and audio parts (extproc/chat.py) before any adapter.
    # A part's caching breakpoint is a cachePoint block after it.
    out: list[dict[str, Any]] = []
    for p in content:
        if p.get("type") == "text" and p.get("text"):
            out.append({"text": p["text"]})
            if p.get("cache_control"):
                out.append(CACHE_POINT)
    return out


def _arguments(text: str | None) -> Any:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def native_body(body: Mapping[str, Any]) -> dict[str, Any]:
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        elif blocks:
            turns.append({"role": role, "content": blocks})

    for m in body["messages"]:
        role = m["role"]
        if role in ("system", "developer"):
            if text := _text_of(m.get("content")):
                system += [{"text": text}, *([CACHE_POINT] if content_hint(m.get("content")) else [])]
        elif role == "assistant":
            blocks = _blocks(m.get("content"))
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                blocks.append({"toolUse": {"toolUseId": call["id"], "name": fn["name"],
                                           "input": _arguments(fn.get("arguments"))}})
            add("assistant", blocks)
        elif role == "tool":
            add("user", [{"toolResult": {"toolUseId": m.get("tool_call_id", ""),
                                         "content": [{"text": _text_of(m.get("content"))}]}},
                         *([CACHE_POINT] if content_hint(m.get("content")) else [])])
        else:
            add("user", _blocks(m.get("content")))
    native: dict[str, Any] = {"messages": turns}
    if system:
        native["system"] = system
    config: dict[str, Any] = {}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit:
        config["maxTokens"] = limit
    for ours, theirs in INFERENCE.items():
        if body.get(ours) is not None:
            config[theirs] = min(body[ours], 1) if ours == "temperature" else body[ours]
    stop = body.get("stop")
    if stop:
        config["stopSequences"] = [stop] if isinstance(stop, str) else list(stop)
        # Converse says `stop_sequence` but not which one; the model family's own answer field names it,
        # returned when asked for by its JSON pointer.
        native["additionalModelResponseFieldPaths"] = ["/stop_sequence"]
    if config:
        native["inferenceConfig"] = config
    if body.get("top_k") is not None:
        native["additionalModelRequestFields"] = {"top_k": body["top_k"]}
    output = _output_schema(body.get("response_format"))
    if body.get("tools") or output is not None:
        tools = []
        for t in body.get("tools") or ():
            spec: dict[str, Any] = {"name": t["function"]["name"], "inputSchema": {
                "json": t["function"].get("parameters") or {"type": "object", "properties": {}}}}
            if t["function"].get("description"):
                spec["description"] = t["function"]["description"]
            tools += [{"toolSpec": spec}, *([CACHE_POINT] if t.get("cache_control") else [])]
        native["toolConfig"] = {"tools": tools}
        choice = body.get("tool_choice")
        if output is not None:
            described = (body["response_format"].get("json_schema") or {}).get("description")
            tools.append({"toolSpec": {"name": OUTPUT_TOOL, "inputSchema": {"json": output}, "description": (
                described or "Give the answer: its input is the answer, following this schema.")}})
            if not isinstance(choice, dict):  # the answer or a call of the caller's tools: some tool
                choice = "required" if body.get("tools") else {"function": {"name": OUTPUT_TOOL}}
        if choice in ("auto", "required"):
            native["toolConfig"]["toolChoice"] = {"auto": {}} if choice == "auto" else {"any": {}}
        elif isinstance(choice, dict):
            native["toolConfig"]["toolChoice"] = {"tool": {"name": choice["function"]["name"]}}
    if body.get("user"):
        native["requestMetadata"] = {"user": str(body["user"])}
    return native


def internal_body(native: Mapping[str, Any], model: str, stream: bool = False) -> dict[str, Any]:
    """A Converse request as the internal contract (the inverse of `native_body` for what both shapes
    carry; the model and whether it streams come from the path)."""
    messages: list[dict[str, Any]] = []
    system = "".join(b.get("text", "") for b in native.get("system") or ())
    if system:
        messages.append({"role": "system", "content": system})
    for turn in native["messages"]:
        blocks = turn["content"]
        if turn["role"] == "assistant":
            uses = [b["toolUse"] for b in blocks if "toolUse" in b]
            calls = [{"id": u["toolUseId"], "type": "function",
                      "function": {"name": u["name"], "arguments": json.dumps(u.get("input") or {})}} for u in uses]
            text = "".join(b["text"] for b in blocks if "text" in b)
            msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
            continue
        texts: list[str] = []
        for b in blocks:
            if "toolResult" in b:
                result = b["toolResult"]
                text = "".join(c.get("text", "") if "text" in c else json.dumps(c.get("json"))
                               for c in result.get("content") or ())
                messages.append({"role": "tool", "tool_call_id": result["toolUseId"], "content": text})
            elif "text" in b:
                texts.append(b["text"])
        if texts:
            messages.append({"role": "user", "content": "".join(texts)})
    body: dict[str, Any] = {"model": model, "messages": messages}
    config = native.get("inferenceConfig") or {}
    body.update(settings_back(config, {"max_tokens": "maxTokens", **INFERENCE}))
    if config.get("stopSequences"):
        body["stop"] = list(config["stopSequences"])
    if (native.get("additionalModelRequestFields") or {}).get("top_k") is not None:
        body["top_k"] = native["additionalModelRequestFields"]["top_k"]
    tool_config = native.get("toolConfig") or {}
    if tool_config.get("tools"):
        body["tools"] = [{"type": "function", "function": {
            "name": t["toolSpec"]["name"], "description": t["toolSpec"].get("description", ""),
            "parameters": (t["toolSpec"].get("inputSchema") or {}).get("json") or {}}} for t in tool_config["tools"]]
        choice = tool_config.get("toolChoice") or {}
        if "tool" in choice:
            body["tool_choice"] = {"type": "function", "function": {"name": choice["tool"]["name"]}}
        elif choice:
            body["tool_choice"] = "required" if "any" in choice else "auto"
    user = (native.get("requestMetadata") or {}).get("user")
    if user:
        body["user"] = user
    if stream:
        body["stream"] = True
    return body


# -- signing ----------------------------------------------------------------------------------------

def host_of(target: Target) -> str:
    region = target.options.get("region", "")
    return target.options.get("host") or f"bedrock-runtime.{region}.amazonaws.com"


SIGNED_HEADERS = ("authorization", "x-amz-date", "x-amz-security-token")  # what `sign` adds


def sign(path: str, headers: Mapping[str, str], body: bytes, target: Target) -> dict[str, str]:
    """The SigV4 headers of this request (authorization, x-amz-date and, with a session token,
    x-amz-security-token). The signed headers are the ones given here and the host; what Envoy adds
    on the way (x-request-id, x-envoy-*) is not signed, as AWS allows."""
    # botocore is imported where a Bedrock request is signed or its stream read, not wherever the
    # configuration loads (every worker, every CLI command): 0.1 s of each one's start.
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    key_id, _, rest = target.credential.partition(":")
    secret, _, token = rest.partition(":")
    request = AWSRequest("POST", f"https://{host_of(target)}{path}", data=body, headers=dict(headers))
    SigV4Auth(Credentials(key_id, secret, token or None), SERVICE, target.options.get("region", "")).add_auth(request)
    return {k.lower(): v for k, v in request.headers.items() if k.lower() not in headers}


class BedrockAdapter:
    name = "bedrock"
    version = 1
    loss_table = LOSS_TABLE

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]:
        model = quote(target.model, safe="")
        return (f"/model/{model}/" + ("converse-stream" if target.stream else "converse"),
                {"content-type": "application/json", ":authority": host_of(target)})

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        path, headers = self.endpoint(target)
        native = orjson.dumps(native_body(body))
        signed = {"content-type": headers["content-type"]}
        return NativeRequest(path, headers, native, tuple(losses(body, LOSS_TABLE)),
                             sign(path, signed, native, target) if target.credential else {})

    def counts(self, target: Target) -> bool:
        return True

    def count_request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        """Bedrock's CountTokens (`/model/{id}/count-tokens`) of the Converse request's input, signed."""
        _, headers = self.endpoint(target)
        converse = native_body(body)
        kept = {k: converse[k] for k in ("messages", "system", "toolConfig") if k in converse}
        path = f"/model/{quote(target.model, safe='')}/count-tokens"
        native = orjson.dumps({"input": {"converse": kept}})
        signed = {"content-type": headers["content-type"]}
        return NativeRequest(path, headers, native, (), sign(path, signed, native, target) if target.credential else {})


BEDROCK = BedrockAdapter()
