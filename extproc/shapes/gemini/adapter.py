"""The `gemini` adapter: the Gemini API's `generateContent` (`POST /v1beta/models/{model}:generateContent`,
streams at `:streamGenerateContent?alt=sse`, the key in `x-goog-api-key`).

Request (internal -> Gemini): system and developer messages become `systemInstruction`; turns become
`contents` with roles `user` and `model` (consecutive turns of one role merge); text and images
(data URLs as `inlineData`, other URLs as `fileData`) become parts; an assistant's `tool_calls` become
`functionCall` parts (arguments as objects) and `tool` messages `functionResponse` parts named after
the call they answer (Gemini matches by name); tools become `functionDeclarations` (with
`parametersJsonSchema`), `tool_choice` the function-calling mode (NONE, AUTO, ANY; a named function
is ANY with `allowedFunctionNames`); sampling settings, `stop`, `seed`, penalties, `max_tokens` and
the JSON output modes go into `generationConfig`.

Answer and stream (Gemini -> internal): the first candidate's text parts join into `content`,
`functionCall` parts become `tool_calls` with ids made here (Gemini sends none), `thought` parts
`reasoning`; `finishReason` maps to `finish_reason` (a function call that ends the turn is
`tool_calls`; the safety reasons are `content_filter`), a prompt blocked before any candidate is a
refusal (`content_filter`). Usage: `promptTokenCount` (cached tokens included, as the internal usage
counts them), `cachedContentTokenCount`, output = candidates + thoughts tokens. A stream is a
sequence of whole responses, each a delta; it has no `[DONE]`: one that ends without a
`finishReason` is broken.
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
    tool_arguments,
)
from extproc.shapes.loss import CACHE_CONTROL, Conditional, LossTable, Support, losses, with_native

S = Support

LOSS_TABLE: LossTable = {
    "stream": S.SUPPORTED,
    "stream_options": S.EMULATED,  # usage arrives with the last response; the chunk is built here
    CACHE_CONTROL: S.EMULATED,  # not sent: the provider caches repeated prefixes on its own (implicit caching)
    "max_tokens": S.TRANSFORMED,  # generationConfig.maxOutputTokens
    "max_completion_tokens": S.TRANSFORMED,
    "temperature": S.TRANSFORMED,  # generationConfig.* from here on: the same meaning, another place
    "top_p": S.TRANSFORMED,
    "top_k": S.TRANSFORMED,
    "stop": S.TRANSFORMED,
    "seed": S.TRANSFORMED,
    "presence_penalty": S.TRANSFORMED,
    "frequency_penalty": S.TRANSFORMED,
    "tools": S.TRANSFORMED,  # functionDeclarations
    "tool_choice": S.TRANSFORMED,  # functionCallingConfig.mode
    "response_format": S.TRANSFORMED,  # responseMimeType (+ responseJsonSchema)
    "cache_salt": S.EMULATED,  # the provider's cache is per project: no tenant salt to send
    "n": Conditional(lambda v: v != 1, "above 1 (one candidate per request)"),
    "parallel_tool_calls": S.UNSUPPORTED,  # no switch for it
    "user": S.UNSUPPORTED,
    "logit_bias": S.UNSUPPORTED,
    "logprobs": S.UNSUPPORTED,  # model-dependent there; not carried
    "top_logprobs": S.UNSUPPORTED,
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
}

FINISH_REASONS = {"STOP": "stop", "MAX_TOKENS": "length", "SAFETY": "content_filter", "RECITATION": "content_filter",
                  "BLOCKLIST": "content_filter", "PROHIBITED_CONTENT": "content_filter", "SPII": "content_filter",
                  "IMAGE_SAFETY": "content_filter", "LANGUAGE": "content_filter", "MALFORMED_FUNCTION_CALL": "stop",
                  "OTHER": "stop"}
GENERATION = {"temperature": "temperature", "top_p": "topP", "top_k": "topK", "seed": "seed",
              "presence_penalty": "presencePenalty", "frequency_penalty": "frequencyPenalty"}


# -- request ----------------------------------------------------------------------------------------

def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict) and p.get("type") == "text")


def _parts(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"text": content}] if content else []
    out: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "text":
            out.append({"text": part["text"]})
        elif part.get("type") == "image_url":
            url = part["image_url"]["url"]
            if url.startswith("data:") and ";base64," in url:
                media, data = url[5:].split(";base64,", 1)
                out.append({"inlineData": {"mimeType": media, "data": data}})
            else:
                out.append({"fileData": {"fileUri": url}})
    return out


def _arguments(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def native_body(body: Mapping[str, Any]) -> dict[str, Any]:
    return with_native(_native_body(body), body)


def _native_body(body: Mapping[str, Any]) -> dict[str, Any]:
    system: list[str] = []
    contents: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> function name, for the results that answer them

    def add(role: str, parts: list[dict[str, Any]]) -> None:
        if contents and contents[-1]["role"] == role:
            contents[-1]["parts"].extend(parts)
        elif parts:
            contents.append({"role": role, "parts": parts})

    for m in body["messages"]:
        role = m["role"]
        if role in ("system", "developer"):
            system.append(_text_of(m.get("content")))
        elif role == "assistant":
            parts = _parts(m.get("content"))
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                names[call["id"]] = fn["name"]
                parts.append({"functionCall": {"name": fn["name"], "args": _arguments(fn.get("arguments"))}})
            add("model", parts)
        elif role == "tool":
            add("user", [{"functionResponse": {"name": names.get(m.get("tool_call_id", ""), m.get("name", "")),
                                               "response": {"content": _text_of(m.get("content"))}}}])
        else:
            add("user", _parts(m.get("content")))
    native: dict[str, Any] = {"contents": contents}
    if system:
        native["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    config: dict[str, Any] = {}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit:
        config["maxOutputTokens"] = limit
    for ours, theirs in GENERATION.items():
        if body.get(ours) is not None:
            config[theirs] = body[ours]
    stop = body.get("stop")
    if stop:
        config["stopSequences"] = [stop] if isinstance(stop, str) else list(stop)
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        config["responseMimeType"] = "application/json"
        if fmt["type"] == "json_schema":
            config["responseJsonSchema"] = (fmt.get("json_schema") or {}).get("schema", {})
    if config:
        native["generationConfig"] = config
    if body.get("tools"):
        native["tools"] = [{"functionDeclarations": [
            {"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "parametersJsonSchema": t["function"].get("parameters") or {"type": "object", "properties": {}}}
            for t in body["tools"]]}]
        choice = body.get("tool_choice")
        if choice is not None:
            mode: dict[str, Any] = {"mode": {"none": "NONE", "auto": "AUTO", "required": "ANY"}.get(
                choice, "ANY") if isinstance(choice, str) else "ANY"}
            if isinstance(choice, dict):
                mode["allowedFunctionNames"] = [choice["function"]["name"]]
            native["toolConfig"] = {"functionCallingConfig": mode}
    return native


def internal_body(native: Mapping[str, Any], model: str, stream: bool = False) -> dict[str, Any]:
    """A generateContent request as the internal contract (the inverse of `native_body` for what both
    shapes carry; the model and whether it streams come from the path). Tool calls get ids made here,
    and a function's response answers the latest call of that name."""
    messages: list[dict[str, Any]] = []
    system = native.get("systemInstruction")
    if isinstance(system, dict):
        messages.append({"role": "system", "content": "".join(p.get("text", "") for p in system.get("parts") or ())})
    ids: dict[str, str] = {}
    for turn in native["contents"]:
        parts = turn.get("parts") or []
        if turn.get("role") == "model":
            calls = []
            for p in parts:
                if "functionCall" in p:
                    fn = p["functionCall"]
                    ids[fn["name"]] = f"call_{len(ids)}_{fn['name']}"
                    calls.append({"id": ids[fn["name"]], "type": "function",
                                  "function": {"name": fn["name"], "arguments": tool_arguments(fn.get("args"))}})
            # A thought part replayed from an earlier answer is the model's reasoning, never its text.
            text = "".join(p.get("text", "") for p in parts if "text" in p and not p.get("thought"))
            thought = "".join(p.get("text", "") for p in parts if "text" in p and p.get("thought"))
            msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning"] = thought
            messages.append(msg)
            continue
        texts: list[dict[str, Any]] = []
        for p in parts:
            if "functionResponse" in p:
                fr = p["functionResponse"]
                result = fr.get("response")
                content = result.get("content") if isinstance(result, dict) and set(result) == {"content"} else result
                messages.append({"role": "tool", "tool_call_id": ids.get(fr.get("name", ""), ""),
                                 "content": content if isinstance(content, str) else json.dumps(content)})
            elif "text" in p:
                texts.append({"type": "text", "text": p["text"]})
            elif "inlineData" in p:
                data = p["inlineData"]
                url = f"data:{data['mimeType']};base64,{data['data']}"
                texts.append({"type": "image_url", "image_url": {"url": url}})
            elif "fileData" in p:
                texts.append({"type": "image_url", "image_url": {"url": p["fileData"]["fileUri"]}})
        if texts:
            only_text = all(t["type"] == "text" for t in texts)
            messages.append({"role": "user", "content": "".join(t["text"] for t in texts) if only_text else texts})
    body: dict[str, Any] = {"model": model, "messages": messages}
    config = native.get("generationConfig") or {}
    body.update(settings_back(config, {"max_tokens": "maxOutputTokens", **GENERATION}))
    if config.get("stopSequences"):
        body["stop"] = list(config["stopSequences"])
    if config.get("candidateCount") is not None:
        body["n"] = config["candidateCount"]
    if config.get("responseMimeType") == "application/json":
        schema = config.get("responseJsonSchema")
        body["response_format"] = ({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
                                   if schema is not None else {"type": "json_object"})
    decls = [d for t in native.get("tools") or () for d in t.get("functionDeclarations") or ()]
    if decls:
        body["tools"] = [{"type": "function", "function": {"name": d["name"], "description": d.get("description", ""),
                                                          "parameters": d.get("parametersJsonSchema") or {}}}
                         for d in decls]
        calling = (native.get("toolConfig") or {}).get("functionCallingConfig") or {}
        mode, allowed = calling.get("mode"), calling.get("allowedFunctionNames") or []
        if mode == "ANY" and len(allowed) == 1:
            body["tool_choice"] = {"type": "function", "function": {"name": allowed[0]}}
        elif mode in ("ANY", "AUTO", "NONE"):
            body["tool_choice"] = {"ANY": "required", "AUTO": "auto", "NONE": "none"}[mode]
    if stream:
        body["stream"] = True
    return body


class GeminiAdapter:
    name = "gemini"
    version = 1
    loss_table = LOSS_TABLE

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]:
        model = quote(target.model, safe="")
        path = f"/v1beta/models/{model}:" + ("streamGenerateContent?alt=sse" if target.stream else "generateContent")
        headers = {"content-type": "application/json"}
        if target.credential:
            headers["x-goog-api-key"] = target.credential
        return path, headers

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        path, headers = self.endpoint(target)
        return NativeRequest(path, headers, orjson.dumps(native_body(body)), tuple(losses(body, LOSS_TABLE)))

    def counts(self, target: Target) -> bool:
        return True

    def count_request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        """The Gemini API's own count (`:countTokens`), of the whole request as it would be generated."""
        _, headers = self.endpoint(target)
        native = native_body(body)
        kept = {k: native[k] for k in ("contents", "systemInstruction", "tools", "toolConfig") if k in native}
        model = quote(target.model, safe="")
        return NativeRequest(f"/v1beta/models/{model}:countTokens", headers, orjson.dumps(
            {"generateContentRequest": {"model": f"models/{target.model}", **kept}}))


GEMINI = GeminiAdapter()
