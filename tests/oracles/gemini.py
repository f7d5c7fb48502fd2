"""The gemini adapter's answer side in Python (extproc/shapes/gemini/adapter.py has its request
side): its answers, streams, errors and usage as the internal shape - what Envoy's Lua answer filter
does in production (extproc/shapes/gemini/answers.lua), and the reference the tests hold it to."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.base import tool_arguments
from extproc.shapes.gemini.adapter import FINISH_REASONS
from extproc.shapes.gemini.adapter import GEMINI as _GEMINI
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

def _usage(meta: Mapping[str, Any]) -> Usage:
    thoughts = token_count(meta.get("thoughtsTokenCount"))
    return Usage(token_count(meta.get("promptTokenCount")), token_count(meta.get("cachedContentTokenCount")),
                 token_count(meta.get("candidatesTokenCount")) + thoughts, thoughts)


def _call_id(response_id: str, n: int) -> str:
    return f"call_{response_id or uuid.uuid4().hex[:12]}_{n}"


def _finish(reason: Any, called: bool) -> str:
    finish = FINISH_REASONS.get(str(reason), "stop")
    return "tool_calls" if called and finish == "stop" else finish


def completion(doc: Mapping[str, Any]) -> dict[str, Any]:
    rid = str(doc.get("responseId", ""))
    candidates = doc.get("candidates") or []
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    refusal = None
    if not candidates:  # the prompt was blocked: no candidate at all
        reason = (doc.get("promptFeedback") or {}).get("blockReason", "OTHER")
        refusal = f"the provider blocked the prompt ({reason})"
        finish = "content_filter"
    else:
        cand = candidates[0]
        for part in (cand.get("content") or {}).get("parts") or ():
            if "functionCall" in part:
                fn = part["functionCall"]
                calls.append({"id": _call_id(rid, len(calls)), "type": "function",
                              "function": {"name": fn["name"], "arguments": tool_arguments(fn.get("args"))}})
            elif part.get("thought"):
                reasoning.append(part.get("text", ""))
            elif "text" in part:
                text.append(part["text"])
        finish = _finish(cand.get("finishReason"), bool(calls))
    return completion_of(rid, doc.get("modelVersion", ""), text, reasoning, calls, finish,
                         _usage(doc.get("usageMetadata") or {}), refusal=refusal)


class GeminiStream(NativeStream):
    """Gemini's SSE (each event a whole response holding the next parts) -> internal chunks."""

    def __init__(self, include_usage: bool = True):
        super().__init__(include_usage)
        self.started = False
        self.calls = 0
        self.usage: Usage | None = None
        self.finished = False

    def _event(self, doc: dict[str, Any]) -> list[bytes]:
        if self.finished:
            raise UpstreamBroken("a response after the finished one")
        if "error" in doc:
            err = doc["error"] if isinstance(doc["error"], dict) else {}
            raise UpstreamBroken(f"the provider ended the stream: {err.get('status', 'error')}")
        try:
            return self._response(doc)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise UpstreamBroken("a malformed stream response") from None

    def _response(self, doc: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            # (no model version: the model the request named, as in the Lua filter)
            self.id, self.model = str(doc.get("responseId", "")), str(doc.get("modelVersion") or self.model)
            out.append(self._chunk({"role": "assistant", "content": ""}))
        if doc.get("usageMetadata"):
            self.usage = _usage(doc["usageMetadata"])
        candidates = doc.get("candidates") or []
        if not candidates and (doc.get("promptFeedback") or {}).get("blockReason"):
            self.finished = True
            return [*out, self._chunk({"refusal": "the provider blocked the prompt"}, "content_filter")]
        for cand in candidates[:1]:
            for part in (cand.get("content") or {}).get("parts") or ():
                if "functionCall" in part:
                    fn = part["functionCall"]
                    # A call arrives whole: its id, name and arguments in one delta.
                    out.append(self._chunk({"tool_calls": [{"index": self.calls, "id": _call_id(self.id, self.calls),
                                                            "type": "function", "function": {
                                                                "name": fn["name"],
                                                                "arguments": tool_arguments(fn.get("args"))}}]}))
                    self.calls += 1
                elif part.get("thought"):
                    out.append(self._chunk({"reasoning": part.get("text", "")}))
                elif part.get("text"):
                    out.append(self._chunk({"content": part["text"]}))
            if cand.get("finishReason"):
                self.finished = True
                out.append(self._chunk({}, _finish(cand["finishReason"], self.calls > 0)))
        return out

    def finish(self) -> list[bytes]:
        if not self.finished:
            raise UpstreamBroken("the stream ended without a finish reason")
        return [*([self._usage_chunk(self.usage or Usage())] if self.include_usage else []), sse("[DONE]")]


# -- errors -----------------------------------------------------------------------------------------

STATUSES = {"RESOURCE_EXHAUSTED": "rate_limited", "UNAVAILABLE": "unavailable", "INTERNAL": "unavailable"}


def failure(status: int, body: bytes) -> Failure:
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    kind = str(err.get("status", "")) if isinstance(err, dict) else ""
    message = str(err.get("message", ""))[:500] if isinstance(err, dict) else ""
    if kind in STATUSES:
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, message or kind, STATUSES[kind])
    if kind == "INVALID_ARGUMENT" and "token" in message and "exceeds" in message:
        return Failure(ErrorCode.CONTEXT_LENGTH_EXCEEDED, 400, message)
    return failure_for_status(status, message)



def response(status: int, body: bytes) -> dict[str, Any]:
    return read_answer(body, lambda doc: "candidates" in doc or "promptFeedback" in doc,
                       "a generateContent response", completion)


GEMINI = Oracle(_GEMINI, response, GeminiStream, failure, _usage)
