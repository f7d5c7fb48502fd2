"""The anthropic adapter's answer side in Python (extproc/shapes/anthropic/adapter.py has its request
side): its answers, streams, errors and usage as the internal shape - what Envoy's Lua answer filter
does in production (extproc/shapes/anthropic/answers.lua), and the reference the tests hold it to."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.anthropic.adapter import ANTHROPIC as _ANTHROPIC
from extproc.shapes.anthropic.adapter import STOP_REASONS
from extproc.shapes.base import tool_arguments
from tests.oracles.base import (
    Failure,
    NativeStream,
    Oracle,
    UpstreamBroken,
    Usage,
    completion_of,
    read_answer,
    sse,
    token_count,
)
from tests.oracles.openai import failure_for_status

# -- answers ----------------------------------------------------------------------------------------

def _usage(native: Mapping[str, Any]) -> Usage:
    """Cache writes split by TTL when `cache_creation` says so (every write a 5-minute one otherwise)."""
    read = token_count(native.get("cache_read_input_tokens"))
    written = token_count(native.get("cache_creation_input_tokens"))
    split = native.get("cache_creation")
    if split is not None and not isinstance(split, dict):
        raise UpstreamBroken("a cache_creation that is no object")
    hour = token_count((split or {}).get("ephemeral_1h_input_tokens"))
    if hour > written:
        raise UpstreamBroken("more 1-hour cache writes than cache writes")
    return Usage(token_count(native.get("input_tokens")) + read + written, read,
                 token_count(native.get("output_tokens")), cache_write=written - hour, cache_write_1h=hour)


def completion(msg: Mapping[str, Any]) -> dict[str, Any]:
    text, reasoning, calls, signatures = [], [], [], []
    for block in msg.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking":
            reasoning.append(block.get("thinking", ""))
            signatures.append(block.get("signature"))
        elif kind == "tool_use":
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": tool_arguments(block.get("input"))}})
    said = msg.get("stop_sequence")
    stop = said if msg.get("stop_reason") == "stop_sequence" and isinstance(said, str) else None
    return completion_of(str(msg.get("id", "")), msg.get("model", ""), text, reasoning, calls,
                         STOP_REASONS.get(str(msg.get("stop_reason")), "stop"), _usage(msg.get("usage") or {}), stop,
                         signature=signatures[0] if len(signatures) == 1 and isinstance(signatures[0], str) else None)


class AnthropicStream(NativeStream):
    """Messages SSE -> internal chunks, one event at a time. Tool-call arguments arrive as pieces of
    JSON (`input_json_delta`) and leave as argument deltas of the same call index."""

    def __init__(self, include_usage: bool = True):
        super().__init__(include_usage)
        self.input = Usage()
        self.output = 0
        self.calls: dict[int, int] = {}  # content block index -> tool call index
        self.finish_reason: str | None = None
        self.stopped = False

    def _event(self, ev: dict[str, Any]) -> list[bytes]:
        if self.stopped:
            raise UpstreamBroken("an event after message_stop")
        kind = ev.get("type")
        try:
            return self._handle(kind, ev)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UpstreamBroken(f"a malformed {kind} event") from None

    def _handle(self, kind: Any, ev: dict[str, Any]) -> list[bytes]:
        if kind == "message_start":
            msg = ev["message"]
            self.id, self.model = str(msg["id"]), str(msg.get("model", ""))
            self.input = _usage(msg.get("usage") or {})
            return [self._chunk({"role": "assistant", "content": ""})]
        if kind == "content_block_start":
            block = ev["content_block"]
            if block["type"] == "tool_use":
                n = self.calls[int(ev["index"])] = len(self.calls)
                return [self._chunk({"tool_calls": [{"index": n, "id": block["id"], "type": "function",
                                                     "function": {"name": block["name"], "arguments": ""}}]})]
            return []
        if kind == "content_block_delta":
            delta = ev["delta"]
            if delta["type"] == "text_delta":
                return [self._chunk({"content": delta["text"]})]
            if delta["type"] == "thinking_delta":
                return [self._chunk({"reasoning": delta["thinking"]})]
            if delta["type"] == "signature_delta":
                if not isinstance(delta["signature"], str):
                    raise TypeError("signature")
                return [self._chunk({"reasoning_signature": delta["signature"]})]
            if delta["type"] == "input_json_delta":
                n = self.calls[int(ev["index"])]
                return [self._chunk({"tool_calls": [{"index": n, "function": {"arguments": delta["partial_json"]}}]})]
            return []  # what the API adds later: nothing to carry
        if kind == "message_delta":
            if (ev.get("usage") or {}).get("input_tokens") is not None:  # cumulative input: it replaces the start's
                self.input = _usage(ev["usage"])
            self.finish_reason = STOP_REASONS.get(str(ev["delta"].get("stop_reason")), "stop")
            self.output = token_count((ev.get("usage") or {}).get("output_tokens")) or self.output
            said = ev["delta"].get("stop_sequence")
            stop = said if ev["delta"].get("stop_reason") == "stop_sequence" and isinstance(said, str) else None
            return [self._chunk({}, self.finish_reason, stop)]
        if kind == "message_stop":
            self.stopped = True
            usage = dataclasses.replace(self.input, output=self.output)
            return [*([self._usage_chunk(usage)] if self.include_usage else []), sse("[DONE]")]
        if kind == "error":
            err = ev.get("error") or {}
            raise UpstreamBroken(f"the provider ended the stream: {err.get('type', 'error')}")
        return []  # ping, content_block_stop

    def finish(self) -> list[bytes]:
        if not self.stopped:
            raise UpstreamBroken("the stream ended before message_stop")
        return []


# -- errors -----------------------------------------------------------------------------------------

ERROR_TYPES = {"rate_limit_error": (ErrorCode.UPSTREAM_ERROR, 502, "rate_limited"),  # see failure_for_status
               "overloaded_error": (ErrorCode.UPSTREAM_ERROR, 502, "overloaded"),
               "api_error": (ErrorCode.UPSTREAM_ERROR, 502, "unavailable")}


def failure(status: int, body: bytes) -> Failure:
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    kind = str(err.get("type", "")) if isinstance(err, dict) else ""
    message = str(err.get("message", ""))[:500] if isinstance(err, dict) else ""
    if kind in ERROR_TYPES:
        code, st, retry = ERROR_TYPES[kind]
        return Failure(code, st, message or kind, retry)
    if kind == "invalid_request_error" and "prompt is too long" in message:
        return Failure(ErrorCode.CONTEXT_LENGTH_EXCEEDED, 400, message)
    return failure_for_status(status, message)



def response(status: int, body: bytes) -> dict[str, Any]:
    return read_answer(body, lambda doc: doc.get("type") == "message", "a message", completion)


ANTHROPIC = Oracle(_ANTHROPIC, response, AnthropicStream, failure, _usage)
