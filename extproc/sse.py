"""An incremental Server-Sent Events reader for OpenAI-style chat streams: fed arbitrary chunks (a
boundary may fall anywhere, even inside a UTF-8 sequence or a `\\r\\n`), it yields each event's data."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from extproc.names import MAX_EVENT_BYTES


class MalformedStream(Exception):
    pass


# An event ends at its first blank line, whichever line ending the stream uses.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\r|\n")  # SSE's three line endings


class EventSplitter:
    """Complete events out of a stream's chunks (each with its blank-line end), in work linear in the
    bytes received: one left-to-right search that resumes where the last one stopped (a separator
    split between chunks is found through the 3 bytes kept before the new ones), each event copied
    once, and what was taken removed once per chunk. `work` counts the bytes searched and copied."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scan = 0  # no event ends before here
        self.work = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        out: list[bytes] = []
        start = 0
        while (m := _EVENT_END.search(buf, self._scan)) is not None:
            end = m.end()
            out.append(bytes(buf[start:end]))
            self.work += (end - self._scan) + (end - start)
            start = self._scan = end
        self.work += len(buf) - self._scan
        if start:
            del buf[:start]
            self.work += len(buf)
        self._scan = max(0, len(buf) - 3)  # a separator is at most 4 bytes
        return out

    @property
    def pending(self) -> int:
        """The bytes of an event still arriving."""
        return len(self._buf)


def event_data(event: bytes) -> str | None:
    """An event's data (its `data:` lines joined), or None for an event without any."""
    lines = [ln[5:].removeprefix(b" ") for ln in _LINE_END.split(event) if ln.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


@dataclass
class SseReader:
    _events: EventSplitter = field(default_factory=EventSplitter)

    def feed(self, chunk: bytes) -> Iterator[str]:
        for event in self._events.feed(chunk):
            data = event_data(event)
            if data is not None:
                yield data
        if self._events.pending > MAX_EVENT_BYTES:
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
