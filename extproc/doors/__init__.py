"""Front doors: the API shapes a client may speak to the gateway besides OpenAI's chat completions.

A door turns its request into the internal contract (extproc/chat.py's chat completion request) at
intake, so identity, authorization, budgets, redaction, routing, fallback and metering run once, on
one shape; its answers, streams and errors are turned back into the caller's shape at the edge, by
the door filter (extproc/door_filter.py), after metering has read the internal shape. Adapters
(extproc/adapters/) are the same translation in the other direction, towards upstreams. Plain values
in and out, no Envoy types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from extproc.doors import anthropic


class DoorStream(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


@dataclass(frozen=True)
class Door:
    name: str
    path: str
    request: Callable[[bytes], dict[str, Any]]  # the raw body -> the internal request (GatewayError)
    answer: Callable[[dict[str, Any]], dict[str, Any]]  # an internal answer -> the caller's
    error: Callable[[int, bytes], bytes]  # a contract error body -> the caller's
    stream: Callable[[], DoorStream]  # internal SSE -> the caller's events
    credential_headers: tuple[str, ...] = ()  # where its SDK puts the key, besides Authorization: Bearer


ANTHROPIC = Door(anthropic.NAME, anthropic.MESSAGES_PATH, anthropic.request, anthropic.answer, anthropic.error,
                 anthropic.MessagesStream, ("x-api-key",))
DOORS: dict[str, Door] = {d.path: d for d in (ANTHROPIC,)}
BY_NAME: dict[str, Door] = {d.name: d for d in DOORS.values()}


def door_for(path: str) -> Door | None:
    """The door a request path opens (the query string aside); None: the chat completions API."""
    return DOORS.get(path.split("?", 1)[0])
