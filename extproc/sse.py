"""An incremental Server-Sent Events reader for OpenAI-style chat streams: fed arbitrary chunks (a
boundary may fall anywhere, even inside a UTF-8 sequence or a `\\r\\n`), it yields each event's data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_EVENT_BYTES = 1 << 20  # an event larger than this is malformed; the stream is reported as such


class MalformedStream(Exception):
    pass


def take_events(buf: bytearray) -> list[bytes]:
    """The complete events at the front of buf (each with its blank-line end), removed from it; what
    remains is the start of an event still arriving."""
    out: list[bytes] = []
    while True:
        cut, sep = -1, 0
        for s in (b"\n\n", b"\r\n\r\n", b"\r\r"):
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, sep = i, len(s)
        if cut == -1:
            return out
        out.append(bytes(buf[: cut + sep]))
        del buf[: cut + sep]


def event_data(event: bytes) -> str | None:
    """An event's data (its `data:` lines joined), or None for an event without any."""
    lines = [ln[5:].removeprefix(b" ") for ln in event.replace(b"\r\n", b"\n").split(b"\n")
             if ln.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


@dataclass
class SseReader:
    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buf += chunk
        for event in take_events(self._buf):
            data = event_data(event)
            if data is not None:
                yield data
        if len(self._buf) > MAX_EVENT_BYTES:
            raise MalformedStream("an SSE event exceeds 1 MiB")


@dataclass
class StreamUsage:
    """What a chat stream says about its tokens: the usage chunk when there is one, and how many
    chunks carried generated content (vLLM sends one token per chunk by default)."""

    usage: dict[str, Any] | None = None
    content_chunks: int = 0
    done: bool = False
    error: bool = False

    def observe(self, data: str) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise MalformedStream("an SSE event is not JSON") from None
        if not isinstance(obj, dict):
            raise MalformedStream("an SSE event is not a JSON object")
        if "error" in obj:
            self.error = True
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning")):
                self.content_chunks += 1
