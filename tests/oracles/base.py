"""What every oracle shares: the stream translator's frame, the reading of a JSON answer, the
internal SSE event, and Oracle - a shape's adapter with its Python answer-side twin beside it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from extproc.contract import ErrorCode
from extproc.shapes.base import Adapter, is_count
from extproc.sse import MalformedStream, SseReader


class UpstreamBroken(Exception):
    """A native answer or stream that does not follow its shape: 502 before the first byte,
    `stream_interrupted` after it. `partial`: what a stream translator made of the events before the
    break in the same chunk (they reach the client before the interruption)."""

    def __init__(self, message: str, partial: list[bytes] | None = None):
        super().__init__(message)
        self.partial = partial or []


def token_count(value: Any) -> int:
    """A usage count as an upstream reports it: absent (None) is 0; anything but a count (is_count)
    breaks the answer that holds it (extproc/lua/answers.lua's `count` reads counts the same way)."""
    if value is None:
        return 0
    if not is_count(value):
        raise UpstreamBroken("a token count no upstream gives")
    return int(value)


@dataclass(frozen=True)
class Usage:
    """Tokens, normalised: `input` includes `cached_input` and the cache writes (as OpenAI counts prompt
    tokens), `output` includes `reasoning`."""

    input: int = 0
    cached_input: int = 0
    output: int = 0
    reasoning: int = 0
    cache_write: int = 0  # at the 5-minute (or only) rate
    cache_write_1h: int = 0

    def openai(self) -> dict[str, Any]:
        details: dict[str, int] = {"cached_tokens": self.cached_input}
        if self.cache_write:
            details["cache_write_tokens"] = self.cache_write
        if self.cache_write_1h:
            details["cache_write_1h_tokens"] = self.cache_write_1h
        out: dict[str, Any] = {"prompt_tokens": self.input, "completion_tokens": self.output,
                               "total_tokens": self.input + self.output, "prompt_tokens_details": details}
        if self.reasoning:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
        return out


@dataclass(frozen=True)
class Failure:
    """A native error as the contract sees it. `retry` is the route's eligible-failure name it counts
    as (`rate_limited`, `overloaded`, `unavailable`), or "" when retrying cannot help."""

    code: ErrorCode
    status: int
    message: str
    retry: str = ""


class StreamTranslator(Protocol):
    def feed(self, chunk: bytes) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


@dataclass(frozen=True)
class Oracle:
    """A shape's adapter (its request side, which production runs) and the Python translations of its
    answers, streams, errors and usage (which production leaves to Envoy's Lua): what the tests read
    a provider's answer with and hold the Lua to. Anything else is the adapter's."""

    adapter: Adapter
    response: Callable[[int, bytes], dict[str, Any]]
    stream_type: Callable[[bool], Any]
    failure: Callable[[int, bytes], Failure]
    usage: Callable[[Mapping[str, Any]], Usage]

    def stream(self, include_usage: bool = True) -> Any:
        return self.stream_type(include_usage)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)


class NativeStream:
    """What every stream translator shares: a native SSE stream in, internal chunks out, a native event
    that does not parse (or any break a subclass finds) raised as UpstreamBroken with the chunks made
    before it in the same feed. Subclasses handle one parsed event (`_event`) and the end (`finish`)."""

    def __init__(self, include_usage: bool = True):
        self.reader = SseReader()
        self.include_usage = include_usage  # the client's, or the gateway's own for metering
        self.id = ""
        self.model = ""
        self.created = int(time.time())

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, stop: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if stop is not None:  # the stop sequence that ended the text, as vLLM's `stop_reason`
            choice["stop_reason"] = stop
        return sse({"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [choice]})

    def _usage_chunk(self, usage: Usage) -> bytes:
        return sse({"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [], "usage": usage.openai()})

    def feed(self, chunk: bytes) -> list[bytes]:
        out: list[bytes] = []
        try:
            for doc in self._documents(chunk):
                out.extend(self._event(doc))
        except MalformedStream as e:
            raise UpstreamBroken(str(e), out) from None
        except UpstreamBroken as e:
            raise UpstreamBroken(str(e), out) from None
        return out

    def _documents(self, chunk: bytes) -> Iterator[dict[str, Any]]:
        """The native events this chunk completes, parsed: SSE events of JSON objects (a shape with
        other framing overrides this)."""
        for data in self.reader.feed(chunk):
            try:
                doc = json.loads(data)
            except ValueError:
                raise UpstreamBroken("a stream event is not JSON") from None
            if not isinstance(doc, dict):
                raise UpstreamBroken("a stream event is not a JSON object")
            yield doc

    def _event(self, doc: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def finish(self) -> list[bytes]:
        raise NotImplementedError


def completion_of(rid: str, model: str, text: list[str], reasoning: list[str], calls: list[dict[str, Any]],
                  finish: str, usage: Usage, stop: str | None = None, refusal: str | None = None,
                  signature: str | None = None) -> dict[str, Any]:
    """An internal chat completion of one choice, as the Lua answer filter's `completion` writes it:
    the text (null when only calls, or a refusal, came), reasoning, tool calls, the finish and - when a
    stop sequence ended the text - vLLM's `stop_reason`; the provider's signature over the reasoning."""
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(text) if refusal is None and (text or not calls) else None}
    if refusal is not None:
        message["refusal"] = refusal
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if signature is not None:
        message["reasoning_signature"] = signature
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    if stop is not None:
        choice["stop_reason"] = stop
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage.openai()}


def read_answer(body: bytes, shaped: Callable[[dict[str, Any]], bool], what: str,
                convert: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """A native JSON answer as the internal chat completion; UpstreamBroken when it does not parse,
    is not `what` (`shaped` says), or lacks what `convert` reads."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise UpstreamBroken("the provider's answer is not JSON") from None
    if not isinstance(doc, dict) or not shaped(doc):
        raise UpstreamBroken(f"the provider's answer is not {what}")
    try:
        return convert(doc)
    except (KeyError, TypeError, AttributeError, ValueError):
        raise UpstreamBroken(f"the provider's {what} is malformed") from None


def sse(doc: Mapping[str, Any] | str) -> bytes:
    """One internal SSE event."""
    data = doc.encode() if isinstance(doc, str) else orjson.dumps(doc)
    return b"data: " + data + b"\n\n"
