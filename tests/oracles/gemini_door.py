"""The Gemini door's answer side in Python (extproc/shapes/gemini/door.py has its request and its
errors): internal answers and streams as Gemini's - what the Lua door filter does in production
(extproc/shapes/gemini/door.lua), and the reference the tests hold it to."""

from __future__ import annotations

import json
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.gemini.door import FINISH, error_body
from tests.oracles.door_stream import InternalStream, first_deltas, reasoning_of
from tests.oracles.openai import OPENAI


def _usage(usage: Any) -> dict[str, int]:
    u = OPENAI.usage(usage if isinstance(usage, dict) else {})  # the internal usage, normalised
    thoughts = min(u.reasoning, u.output)  # Gemini counts the thoughts apart from the answer
    out = {"promptTokenCount": u.input, "candidatesTokenCount": u.output - thoughts,
           "totalTokenCount": u.input + u.output}
    if u.cached_input:
        out["cachedContentTokenCount"] = u.cached_input
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    return out


def _args(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _response_id(internal_id: Any) -> str:
    return str(internal_id or "").removeprefix("chatcmpl-")


def answer(doc: dict[str, Any]) -> dict[str, Any]:
    candidates = []
    for choice in doc.get("choices") or ():
        msg = choice.get("message") or {}
        reasoning = reasoning_of(msg)
        parts: list[dict[str, Any]] = [{"text": reasoning, "thought": True}] if reasoning else []
        parts += [{"text": msg["content"]}] if msg.get("content") else []
        parts += [{"functionCall": {"name": (c.get("function") or {}).get("name", ""),
                                    "args": _args((c.get("function") or {}).get("arguments", ""))}}
                  for c in msg.get("tool_calls") or ()]
        candidates.append({"content": {"role": "model", "parts": parts or [{"text": ""}]},
                           "finishReason": FINISH.get(choice.get("finish_reason") or "", "OTHER"),
                           "index": choice.get("index", 0)})
    return {"candidates": candidates, "usageMetadata": _usage(doc.get("usage")),
            "modelVersion": doc.get("model", ""), "responseId": _response_id(doc.get("id"))}


class GenerateContentStream(InternalStream):
    """Internal SSE chunks in; Gemini's stream of responses out (`data: {...}` CRLF CRLF)."""

    def __init__(self) -> None:
        super().__init__()
        self.id = ""
        self.model = ""
        self.calls: dict[int, dict[str, str]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None

    def _frame(self, doc: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(doc).encode() + b"\r\n\r\n"

    def _response(self, parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
        cand: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
        if finish:
            cand["finishReason"] = finish
        return {"candidates": [cand], "modelVersion": self.model, "responseId": self.id}

    def _error_event(self, message: str) -> bytes:
        return self._frame(json.loads(error_body(500, message, ErrorCode.STREAM_INTERRUPTED.value)))

    def _done(self) -> list[bytes]:
        parts = [{"functionCall": {"name": c["name"], "args": _args(c["arguments"])}}
                 for _, c in sorted(self.calls.items())]
        doc = self._response(parts or [{"text": ""}], self.finish_reason or "STOP")
        if self.usage is not None:
            doc["usageMetadata"] = self.usage
        return [self._frame(doc)]

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        self.id = self.id or _response_id(obj.get("id"))
        self.model = self.model or str(obj.get("model", ""))
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        out: list[bytes] = []
        for choice, delta in first_deltas(obj):
            if reasoning := reasoning_of(delta):
                out.append(self._frame(self._response([{"text": reasoning, "thought": True}])))
            if delta.get("content"):
                out.append(self._frame(self._response([{"text": delta["content"]}])))
            for call in delta.get("tool_calls") or ():  # whole calls leave with the last response
                c = self.calls.setdefault(int(call.get("index", 0)), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                c["name"] += fn.get("name") or ""
                c["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = FINISH.get(choice["finish_reason"], "OTHER")
        return out
