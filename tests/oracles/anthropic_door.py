"""The Anthropic door's answer side in Python (extproc/shapes/anthropic/door.py has its request and
its errors): internal answers and streams as Anthropic's - what the Lua door filter does in production
(extproc/shapes/anthropic/door.lua), and the reference the tests hold it to."""

from __future__ import annotations

import json
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.anthropic.door import STOP_REASONS
from tests.oracles.door_stream import InternalStream, first_deltas, reasoning_of
from tests.oracles.openai import OPENAI


def _stop(finish: str | None, stop_reason: Any, called: bool = False) -> tuple[str, str | None]:
    if finish == "stop" and called:
        return "tool_use", None  # a forced tool call finishes with "stop" on vLLM
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason  # vLLM names the stop string that ended the text
    return STOP_REASONS.get(finish or "", "end_turn"), None


def _usage(usage: Any) -> dict[str, Any]:
    u = OPENAI.usage(usage if isinstance(usage, dict) else {})  # the internal usage, normalised
    writes = u.cache_write + u.cache_write_1h
    return {"input_tokens": u.input - u.cached_input - writes, "cache_creation_input_tokens": writes,
            "cache_read_input_tokens": u.cached_input,
            "cache_creation": {"ephemeral_5m_input_tokens": u.cache_write,
                               "ephemeral_1h_input_tokens": u.cache_write_1h},
            "output_tokens": u.output}


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_id(internal_id: Any) -> str:
    bare = str(internal_id or "").removeprefix("chatcmpl-")
    return bare if bare.startswith("msg_") else "msg_" + bare


def answer(doc: dict[str, Any]) -> dict[str, Any]:
    """An internal chat completion as a Message (the first choice: the Messages API has no `n`)."""
    choice = (doc.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning, signature = reasoning_of(msg), msg.get("reasoning_signature")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning,
                        "signature": signature if isinstance(signature, str) else ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""),
                        "input": _input(fn.get("arguments", ""))})
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"),
                                       bool(msg.get("tool_calls")))
    return {"id": _message_id(doc.get("id")), "type": "message", "role": "assistant", "model": doc.get("model", ""),
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(doc.get("usage"))}


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **doc}).encode() + b"\n\n"


class MessagesStream(InternalStream):
    """Internal SSE chunks (whole events or not) in, Anthropic's events out."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False
        self.index = -1  # the open content block's index
        self.open: str | None = None  # "text" or the open tool call's internal index
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.usage: dict[str, Any] | None = None
        self.called = False

    def _error_event(self, message: str) -> bytes:
        return _event("error", {"error": {"type": "api_error", "message": message,
                                          "code": ErrorCode.STREAM_INTERRUPTED.value}})

    def _start(self, obj: dict[str, Any]) -> list[bytes]:
        self.started = True
        return [_event("message_start", {"message": {
            "id": _message_id(obj.get("id")), "type": "message", "role": "assistant", "model": obj.get("model", ""),
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                      "output_tokens": 0}}})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _open(self, key: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = key
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def _done(self) -> list[bytes]:
        out = self._start({}) if not self.started else []
        out += self._close()
        reason, sequence = self.stop
        return [*out, _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                               "usage": self.usage or {"output_tokens": 0}}),
                _event("message_stop", {})]

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        out = [] if self.started else self._start(obj)
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        for choice, delta in first_deltas(obj):
            reasoning, signature = reasoning_of(delta), delta.get("reasoning_signature")
            for kind, value in (("thinking", reasoning), ("signature", signature)):
                if not isinstance(value, str) or not value:
                    continue
                if self.open != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(_event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": f"{kind}_delta", kind: value}}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls") or ():
                key = f"tool{call.get('index', 0)}"
                self.called = True
                fn = call.get("function") or {}
                if self.open != key:
                    out += self._open(key, {"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""),
                                            "input": {}})
                if fn.get("arguments"):
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}))
            if choice.get("finish_reason"):
                out += self._close()
                self.stop = _stop(choice["finish_reason"], choice.get("stop_reason"), self.called)
        return out
