"""What every front door's stream shares: the internal SSE (whole events or not, already checked by
the stream guard) read one event at a time, and an end that is never a normal finish unless the
stream said `[DONE]`: the contract's `stream_interrupted`, garbage, an oversized event or an end
without `[DONE]` become the door's error event, and nothing follows it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from extproc.names import MAX_EVENT_BYTES
from extproc.sse import EventSplitter, event_data
from tests.oracles.base import UpstreamBroken


def reasoning_of(msg: dict[str, Any]) -> str | None:
    """A message's (or delta's) reasoning text (`reasoning`, or vLLM's older `reasoning_content`)."""
    r = msg.get("reasoning")
    if r is None:
        r = msg.get("reasoning_content")
    return r if isinstance(r, str) and r else None


def first_deltas(obj: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """An internal chunk's first choice (a door has no `n`) and its delta, as the Lua's walk_chunk reads them."""
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            yield choice, choice.get("delta") or {}


class InternalStream:
    def __init__(self) -> None:
        self.events = EventSplitter()
        self.ended = False

    def feed(self, chunk: bytes) -> bytes:
        if self.ended:
            return b""
        out: list[bytes] = []
        for event in self.events.feed(chunk):
            data = event_data(event)
            if data is None:
                continue  # a comment (keep-alive): the caller's events are its API's own
            out += self._one(data)
            if self.ended:
                break
        if self.events.pending > MAX_EVENT_BYTES and not self.ended:
            out += self._failed("an event of the stream exceeds 1 MiB")
        return b"".join(out)

    def finish(self) -> bytes:
        """The stream ended: one that never said [DONE] is interrupted, never finished."""
        return b"" if self.ended else b"".join(self._failed("the stream ended before its end"))

    def _failed(self, message: str) -> list[bytes]:
        self.ended = True
        return [self._error_event(message)]

    def _one(self, data: str) -> list[bytes]:
        if data.strip() == "[DONE]":
            self.ended = True
            return self._done()
        try:
            obj = json.loads(data)
        except ValueError:
            return self._failed("the stream is malformed")
        if not isinstance(obj, dict):
            return self._failed("the stream is malformed")
        if "error" in obj:  # the contract's stream_interrupted (or an upstream's error event)
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            return self._failed(str(err.get("message", "the stream was interrupted")))
        try:
            return self._chunk(obj)
        except UpstreamBroken as e:  # a chunk the door cannot carry (a usage count no upstream gives)
            return self._failed(str(e))

    # -- the door's --------------------------------------------------------------------------------

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        """One internal chunk in the caller's events."""
        raise NotImplementedError

    def _done(self) -> list[bytes]:
        """The events that end a finished stream."""
        raise NotImplementedError

    def _error_event(self, message: str) -> bytes:
        raise NotImplementedError
