"""What every adapter shares: the values that cross the adapter boundary, and the protocol."""


from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from extproc.contract import ErrorCode
from extproc.shapes.loss import Loss, LossTable
from extproc.sse import MalformedStream, SseReader


class UpstreamBroken(Exception):
    """A native answer or stream that does not follow its shape: 502 before the first byte,
    `stream_interrupted` after it. `partial`: what a stream translator made of the events before the
    break in the same chunk (they reach the client before the interruption)."""

    def __init__(self, message: str, partial: list[bytes] | None = None):
        super().__init__(message)
        self.partial = partial or []


MAX_COUNT = 2**53  # no upstream counts more tokens than this for one request


def is_count(value: Any) -> bool:
    """Whether a value is a token count an upstream gives: a whole number from 0 to 2^53. A negative
    one would refund a budget, a huge one drain it, and `2.5`, `"7"` or `true` read as one would
    charge what the upstream never said."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
            and value == int(value))


def token_count(value: Any) -> int:
    """A usage count as an upstream reports it: absent (None) is 0; anything but a count (is_count)
    breaks the answer that holds it (extproc/lua/answers.lua's `count` reads counts the same way)."""
    if value is None:
        return 0
    if not is_count(value):
        raise UpstreamBroken("a token count no upstream gives")
    return int(value)


@dataclass(frozen=True)
class Target:
    """What an adapter needs to know of the candidate it translates for."""

    model: str  # the model name the upstream serves
    credential: str = ""  # resolved from the deployment's credential_ref; never logged
    options: Mapping[str, str] = field(default_factory=dict)  # per-shape settings (Azure's api_version)
    stream: bool = False  # the answer is a stream (Gemini's path says so)


@dataclass(frozen=True)
class NativeRequest:
    path: str
    headers: Mapping[str, str]
    body: bytes
    losses: tuple[Loss, ...] = ()
    # Headers that depend on the body (a request signature): set with the body, after `endpoint`'s.
    signed_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    """Tokens, normalised: `input` includes `cached_input` (as OpenAI counts prompt tokens)."""

    input: int = 0
    cached_input: int = 0
    output: int = 0
    reasoning: int = 0

    def openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": self.input, "completion_tokens": self.output,
                               "total_tokens": self.input + self.output,
                               "prompt_tokens_details": {"cached_tokens": self.cached_input}}
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


class Adapter(Protocol):
    name: str
    version: int
    loss_table: LossTable

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]: ...

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest: ...

    def response(self, status: int, body: bytes) -> dict[str, Any]: ...

    def stream(self, include_usage: bool = True) -> StreamTranslator: ...

    def failure(self, status: int, body: bytes) -> Failure: ...

    def usage(self, native: Mapping[str, Any]) -> Usage: ...


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

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": finish}]})

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


class ShapeAdapter:
    """What every adapter of another API shape writes alike: its stream translator is `stream_type`,
    and its module's `failure` and `usage` functions are its own (set as static methods)."""

    stream_type: type[NativeStream]

    def stream(self, include_usage: bool = True) -> NativeStream:
        return self.stream_type(include_usage)


def tool_arguments(given: Any) -> str:
    """A tool call's input (a JSON object, or absent) as the internal arguments string; ValueError for
    anything else (read_answer makes that a broken answer)."""
    if given is not None and not isinstance(given, dict):
        raise ValueError("a tool's input is not an object")
    return json.dumps(given or {})


def settings_back(native: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """The internal request fields a native settings object holds (`names`: internal -> native), for
    the inverse translations."""
    return {ours: native[theirs] for ours, theirs in names.items() if native.get(theirs) is not None}


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
