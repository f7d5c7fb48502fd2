"""The Responses door's answer side in Python (extproc/shapes/openai/door.py has its request and its
errors): internal answers and streams as OpenAI's Responses API writes them - what the Lua door filter
does in production (extproc/shapes/openai/door.lua), and the reference the tests hold it to."""

from __future__ import annotations

import json
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.openai.door import INCOMPLETE
from tests.oracles.door_stream import InternalStream, first_deltas, reasoning_of
from tests.oracles.openai import OPENAI


def _usage(usage: Any) -> dict[str, Any]:
    u = OPENAI.usage(usage if isinstance(usage, dict) else {})
    return {"input_tokens": u.input, "input_tokens_details": {"cached_tokens": u.cached_input},
            "output_tokens": u.output, "output_tokens_details": {"reasoning_tokens": min(u.reasoning, u.output)},
            "total_tokens": u.input + u.output}


def _bare(internal_id: Any) -> str:
    return str(internal_id or "").removeprefix("chatcmpl-")


def _item_id(prefix: str, bare: str, index: int) -> str:
    return f"{prefix}_{bare}_{index}"


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _reasoning(item_id: str, text: str | None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id,
            "summary": [{"type": "summary_text", "text": text}] if text is not None else []}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _status(finish: Any) -> tuple[str, dict[str, str] | None]:
    reason = INCOMPLETE.get(finish) if isinstance(finish, str) else None
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def _response(bare: str, created: Any, model: str, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: dict[str, str] | None = None,
              error: dict[str, str] | None = None) -> dict[str, Any]:
    return {"id": f"resp_{bare}", "object": "response",
            "created_at": created if isinstance(created, int) and not isinstance(created, bool) else 0,
            "status": status, "error": error, "incomplete_details": incomplete, "model": model, "output": output,
            "usage": usage}


def answer(doc: dict[str, Any]) -> dict[str, Any]:
    """An internal chat completion as a Response (the first choice: the Responses API has no `n`)."""
    choice = (doc.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    bare = _bare(doc.get("id"))
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(msg)
    if reasoning:
        output.append(_reasoning(_item_id("rs", bare, len(output)), reasoning))
    if msg.get("content"):
        output.append(_message(_item_id("msg", bare, len(output)), msg["content"]))
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        output.append(_call(_item_id("fc", bare, len(output)), call.get("id", ""), fn.get("name", ""),
                            fn.get("arguments") or ""))
    status, incomplete = _status(choice.get("finish_reason"))
    return _response(bare, doc.get("created"), doc.get("model", ""), status, output, _usage(doc.get("usage")),
                     incomplete)


class ResponsesStream(InternalStream):
    """Internal SSE chunks (whole events or not) in, the Responses API's events out."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = 0
        self.started = False
        self.bare, self.created, self.model = "", 0, ""
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: str | None = None  # "reasoning", "message" or "call<n>"
        self.item_id = ""
        self.text = ""  # the open item's text or arguments so far
        self.call: tuple[str, str] = ("", "")  # the open call's id and name
        self.finish_reason: Any = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, doc: dict[str, Any]) -> bytes:
        out = f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, "sequence_number": self.seq, **doc}
                                                            ).encode() + b"\n\n"
        self.seq += 1
        return out

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return _response(self.bare, self.created, self.model, status, list(self.output), self.usage, **kw)

    def _start(self, obj: dict[str, Any]) -> list[bytes]:
        self.started = True
        self.bare, self.created, self.model = _bare(obj.get("id")), obj.get("created"), obj.get("model", "")
        return [self._event("response.created", {"response": self._snapshot("in_progress")}),
                self._event("response.in_progress", {"response": self._snapshot("in_progress")})]

    def _error_event(self, message: str) -> bytes:
        out = b"".join(self._start({})) if not self.started else b""
        return out + self._event("response.failed", {"response": self._snapshot(
            "failed", error={"code": ErrorCode.STREAM_INTERRUPTED.value, "message": message})})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, index, item_id, text = self.open, len(self.output), self.item_id, self.text
        self.open = None
        where = {"item_id": item_id, "output_index": index}
        if kind == "reasoning":
            item = _reasoning(item_id, text)
            part = {"type": "summary_text", "text": text}
            out = [self._event("response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text}),
                   self._event("response.reasoning_summary_part.done", {**where, "summary_index": 0, "part": part})]
        elif kind == "message":
            item = _message(item_id, text)
            part = {"type": "output_text", "text": text, "annotations": []}
            out = [self._event("response.output_text.done", {**where, "content_index": 0, "text": text}),
                   self._event("response.content_part.done", {**where, "content_index": 0, "part": part})]
        else:
            item = _call(item_id, self.call[0], self.call[1], text)
            out = [self._event("response.function_call_arguments.done", {**where, "arguments": text})]
        self.output.append(item)
        return [*out, self._event("response.output_item.done", {"output_index": index, "item": item})]

    def _open(self, kind: str, prefix: str, call: tuple[str, str] = ("", "")) -> list[bytes]:
        out = self._close()
        index = len(self.output)
        self.open, self.item_id, self.text, self.call = kind, _item_id(prefix, self.bare, index), "", call
        where = {"item_id": self.item_id, "output_index": index}
        if kind == "reasoning":
            return [*out, self._event("response.output_item.added", {
                        "output_index": index, "item": _reasoning(self.item_id, None)}),
                    self._event("response.reasoning_summary_part.added", {
                        **where, "summary_index": 0, "part": {"type": "summary_text", "text": ""}})]
        if kind == "message":
            return [*out, self._event("response.output_item.added", {
                        "output_index": index, "item": _message(self.item_id, "", "in_progress")}),
                    self._event("response.content_part.added", {
                        **where, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})]
        return [*out, self._event("response.output_item.added", {
            "output_index": index, "item": _call(self.item_id, call[0], call[1], "", "in_progress")})]

    def _delta(self, kind: str, prefix: str, event: str, value: str, index_field: str | None) -> list[bytes]:
        out = self._open(kind, prefix) if self.open != kind else []
        self.text += value
        where: dict[str, Any] = {"item_id": self.item_id, "output_index": len(self.output)}
        if index_field:
            where[index_field] = 0
        return [*out, self._event(event, {**where, "delta": value})]

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        out = [] if self.started else self._start(obj)
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        for choice, delta in first_deltas(obj):
            reasoning = reasoning_of(delta)
            if reasoning:
                out += self._delta("reasoning", "rs", "response.reasoning_summary_text.delta", reasoning,
                                   "summary_index")
            if delta.get("content"):
                out += self._delta("message", "msg", "response.output_text.delta", delta["content"], "content_index")
            for call in delta.get("tool_calls") or ():
                key = f"call{call.get('index', 0)}"
                fn = call.get("function") or {}
                if self.open != key:
                    out += self._open(key, "fc", (call.get("id", ""), fn.get("name", "")))
                if fn.get("arguments"):
                    out += self._delta(key, "fc", "response.function_call_arguments.delta", fn["arguments"], None)
            if choice.get("finish_reason"):
                out += self._close()
                self.finish_reason = choice["finish_reason"]
        return out

    def _done(self) -> list[bytes]:
        out = self._start({}) if not self.started else []
        out += self._close()
        status, incomplete = _status(self.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self._event(kind, {"response": self._snapshot(status, incomplete=incomplete)})]
