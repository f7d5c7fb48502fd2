"""The `anthropic` adapter: the Messages API (`POST /v1/messages`, `anthropic-version: 2023-06-01`).

Request (internal -> Messages): system and developer messages are hoisted into `system`; content
parts become content blocks (text, images from data URLs or URLs); an assistant's `tool_calls` become
`tool_use` blocks and `tool` messages `tool_result` blocks of a user turn; consecutive turns of one role
merge (the API wants them alternating); `max_tokens` is required (the route's bound when the client
sent none); `stop` becomes `stop_sequences`; tools become `{name, description, input_schema}` and
`tool_choice` `{type: auto | any | tool | none}`, `parallel_tool_calls: false` its
`disable_parallel_tool_use`; `user` becomes `metadata.user_id`.

Answer and stream (Messages -> internal): text blocks join into `content`, `tool_use` blocks become
`tool_calls` (arguments as JSON text; streamed as `input_json_delta` pieces, re-emitted as argument
deltas of the same call index), `thinking` becomes `reasoning`; `stop_reason` maps to `finish_reason`;
usage counts cache reads and writes as prompt tokens (cache reads as cached). An `error` event in the
stream, or a stream that ends before `message_stop`, is broken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from extproc.shapes.base import (
    NativeRequest,
    Target,
)
from extproc.shapes.loss import CACHE_CONTROL, Conditional, LossTable, Support, content_hint, losses, with_native

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096
S = Support


def _over_one(v: Any) -> bool:
    return isinstance(v, (int, float)) and v > 1


LOSS_TABLE: LossTable = {
    "stream": S.SUPPORTED,
    "stream_options": S.EMULATED,  # usage arrives in message_start / message_delta; the chunk is built
    "max_tokens": S.SUPPORTED,
    "max_completion_tokens": S.TRANSFORMED,  # sent as max_tokens
    "temperature": Conditional(_over_one, "above 1 (clamped to 1, the API's range)", loss=S.TRANSFORMED),
    "top_p": S.SUPPORTED,
    "top_k": S.SUPPORTED,
    "stop": S.TRANSFORMED,  # stop_sequences
    "tools": S.TRANSFORMED,  # input_schema
    "tool_choice": S.TRANSFORMED,  # {type: auto | any | tool | none}
    "parallel_tool_calls": S.TRANSFORMED,  # tool_choice.disable_parallel_tool_use
    "user": S.TRANSFORMED,  # metadata.user_id
    "cache_salt": S.EMULATED,  # the provider's cache is per account: no tenant salt to send
    CACHE_CONTROL: S.SUPPORTED,  # on the text blocks, tool results and tools it marks
    "n": Conditional(lambda v: v != 1, "above 1 (one answer per request)"),
    "seed": S.UNSUPPORTED,
    "frequency_penalty": S.UNSUPPORTED,
    "presence_penalty": S.UNSUPPORTED,
    "logit_bias": S.UNSUPPORTED,
    "logprobs": S.UNSUPPORTED,
    "top_logprobs": S.UNSUPPORTED,
    # json_schema -> output_config.format; json_object (no schema to give) has no equivalent
    "response_format": Conditional(lambda v: v.get("type") != "json_schema", "other than json_schema",
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
}

STOP_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                "refusal": "content_filter", "pause_turn": "stop", "model_context_window_exceeded": "length"}


# -- request ----------------------------------------------------------------------------------------

def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict) and p.get("type") == "text")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    out: list[dict[str, Any]] = []
    for part in content:
        if part.get("type") == "text":
            out.append({"type": "text", "text": part["text"],
                        **({"cache_control": part["cache_control"]} if part.get("cache_control") else {})})
        elif part.get("type") == "image_url":
            url = part["image_url"]["url"]
            if url.startswith("data:") and ";base64," in url:
                media, data = url[5:].split(";base64,", 1)
                out.append({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
            else:
                out.append({"type": "image", "source": {"type": "url", "url": url}})
    return out


def _turns(messages: list[dict[str, Any]]) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    """(system text - or its text blocks, when one carries a caching breakpoint - and alternating
    user/assistant turns)."""
    system: list[Any] = []  # the system messages' contents
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for m in messages:
        role = m["role"]
        if role in ("system", "developer"):
            system.append(m.get("content"))
        elif role == "user":
            add("user", _blocks(m.get("content")))
        elif role == "assistant":
            blocks = _blocks(m.get("content"))
            # Reasoning goes back only as the provider signed it; unsigned, it is not sent (the API
            # refuses a thinking block without its signature).
            if m.get("reasoning") and m.get("reasoning_signature"):
                blocks.insert(0, {"type": "thinking", "thinking": m["reasoning"],
                                  "signature": m["reasoning_signature"]})
            for call in m.get("tool_calls") or ():
                try:
                    args = json.loads(call["function"].get("arguments") or "{}")
                except ValueError:
                    args = {"_raw": call["function"].get("arguments")}
                blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args})
            add("assistant", blocks)
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": _text_of(m.get("content"))}
            hint = content_hint(m.get("content"))
            add("user", [{**result, "cache_control": hint} if hint else result])
    blocks = [b for content in system for b in _blocks(content)]
    if any("cache_control" in b for b in blocks):
        return blocks, turns
    return "\n\n".join(t for content in system if (t := _text_of(content))), turns


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any] | None
    if choice is None:
        out = {"type": "auto"} if parallel is False else None
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "required":
        out = {"type": "any"}
    elif choice == "none":
        out = {"type": "none"}
    else:
        out = {"type": "tool", "name": choice["function"]["name"]}
    if out is not None and parallel is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


def native_body(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    return with_native(_native_body(body, model), body)


def _native_body(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    system, turns = _turns(list(body["messages"]))
    native: dict[str, Any] = {"model": model, "messages": turns,
                              "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens")
                              or DEFAULT_MAX_TOKENS}
    if system:
        native["system"] = system
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(ours) is not None:
            native[theirs] = min(body[ours], 1) if ours == "temperature" else body[ours]
    stop = body.get("stop")
    if stop:
        native["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("stream"):
        native["stream"] = True
    if body.get("tools"):
        native["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                            "input_schema": t["function"].get("parameters") or {"type": "object", "properties": {}},
                            **({"cache_control": t["cache_control"]} if t.get("cache_control") else {})}
                           for t in body["tools"]]
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            native["tool_choice"] = choice
    if body.get("user"):
        native["metadata"] = {"user_id": body["user"]}
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        native["output_config"] = {"format": {"type": "json_schema", "schema": fmt["json_schema"].get("schema", {})}}
    return native


def internal_body(native: Mapping[str, Any]) -> dict[str, Any]:
    """A Messages request as the internal contract (the Anthropic front door's direction, and the
    inverse of `native_body` for what both shapes carry)."""
    messages: list[dict[str, Any]] = []
    system = native.get("system")
    if system:
        messages.append({"role": "system", "content": system if isinstance(system, str)
                         else _collapse([_text_part(b) for b in system if b.get("type") == "text"])})
    for turn in native["messages"]:
        content = turn["content"]
        blocks: list[dict[str, Any]] = ([{"type": "text", "text": content}] if isinstance(content, str)
                                        else list(content))
        if turn["role"] == "system":  # a system turn where it stands (its text blocks)
            messages.append({"role": "system", "content": _collapse([_text_part(b) for b in blocks
                                                                     if b.get("type") == "text"])})
            continue
        if turn["role"] == "assistant":
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}}
                     for b in blocks if b.get("type") == "tool_use"]
            texts = [_text_part(b) for b in blocks if b.get("type") == "text"]
            text = _collapse(texts) if texts else ""
            msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            thoughts = [b for b in blocks if b.get("type") == "thinking"]
            if thoughts:  # the reasoning, and (one block) the provider's signature over it
                msg["reasoning"] = "".join(b["thinking"] for b in thoughts)
                if len(thoughts) == 1:
                    msg["reasoning_signature"] = thoughts[0]["signature"]
            messages.append(msg)
            continue
        parts: list[dict[str, Any]] = []
        for b in blocks:
            if b.get("type") == "tool_result":
                if parts:
                    messages.append({"role": "user", "content": _collapse(parts)})
                    parts = []
                result = b.get("content")
                text = result if isinstance(result, str) else _text_of(result)
                hint = b.get("cache_control") or content_hint(result)  # the block's, or its text's
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": (
                    [{"type": "text", "text": text, "cache_control": hint}] if hint else text)})
            elif b.get("type") == "text":
                parts.append(_text_part(b))
            elif b.get("type") == "image":
                src = b["source"]
                url = src["url"] if src["type"] == "url" else f"data:{src['media_type']};base64,{src['data']}"
                parts.append({"type": "image_url", "image_url": {"url": url}})
        if parts:
            messages.append({"role": "user", "content": _collapse(parts)})
    body: dict[str, Any] = {"model": native["model"], "messages": messages, "max_tokens": native["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "stream"):
        if native.get(key) is not None:
            body[key] = native[key]
    if native.get("stop_sequences"):
        body["stop"] = list(native["stop_sequences"])
    if native.get("tools"):
        body["tools"] = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t.get("input_schema") or {}},
                          **({"cache_control": t["cache_control"]} if t.get("cache_control") else {})}
                         for t in native["tools"]]
    choice = native.get("tool_choice")
    if choice:
        kind = choice.get("type")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            kind, {"type": "function", "function": {"name": choice.get("name", "")}})
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False
    user = (native.get("metadata") or {}).get("user_id")
    if user:
        body["user"] = user
    fmt = (native.get("output_config") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return body


def _text_part(block: Mapping[str, Any]) -> dict[str, Any]:
    """A text block as a text part, its caching breakpoint kept."""
    return {"type": "text", "text": block["text"],
            **({"cache_control": block["cache_control"]} if block.get("cache_control") else {})}


def _collapse(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text-only content as one string (how most clients send it); mixed content, or text that carries
    a caching breakpoint, as parts."""
    if all(p["type"] == "text" and "cache_control" not in p for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


class AnthropicAdapter:
    name = "anthropic"
    version = 1
    loss_table = LOSS_TABLE

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]:
        """The path and headers of every request to this target."""
        headers = {"content-type": "application/json", "anthropic-version": API_VERSION}
        if target.credential:
            headers["x-api-key"] = target.credential
        return "/v1/messages", headers

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        path, headers = self.endpoint(target)
        return NativeRequest(path, headers, orjson.dumps(native_body(body, target.model)),
                             tuple(losses(body, LOSS_TABLE)))

    def counts(self, target: Target) -> bool:
        return True

    def count_request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        """The Messages API's own count (`/v1/messages/count_tokens`): the request's prompt fields."""
        _, headers = self.endpoint(target)
        native = native_body(body, target.model)
        kept = {k: native[k] for k in ("model", "messages", "system", "tools", "tool_choice") if k in native}
        return NativeRequest("/v1/messages/count_tokens", headers, orjson.dumps(kept))


ANTHROPIC = AnthropicAdapter()
