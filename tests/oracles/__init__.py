"""The Python twins of the translations Envoy's Lua runs in production: each shape's answers, streams,
errors and usage (tests/oracles/<shape>.py) and each front door's answers and streams
(tests/oracles/<shape>_door.py). No production path runs them: they are the reference the Lua is
held to (tests/lua/), and how the tests read a provider's or a door's answer. `oracle(adapter)` is a
shape's adapter with its twin beside it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.shapes.base import Adapter
from extproc.shapes.door import Door
from tests.oracles import anthropic, anthropic_door, bedrock, gemini, gemini_door, openai, openai_door
from tests.oracles.base import Oracle

ORACLES: dict[str, Oracle] = {o.adapter.name: o for o in (anthropic.ANTHROPIC, bedrock.BEDROCK, gemini.GEMINI,
                                                           openai.OPENAI)}


def oracle(adapter: Adapter) -> Oracle:
    return ORACLES[adapter.name]


@dataclass(frozen=True)
class DoorOracle:
    """A front door's answer side in Python: an internal answer as the caller's, and the translator of
    internal SSE into the caller's events."""

    answer: Callable[[dict[str, Any]], dict[str, Any]]
    stream: Callable[[], Any]


DOOR_ORACLES = {"anthropic": DoorOracle(anthropic_door.answer, anthropic_door.MessagesStream),
                "gemini": DoorOracle(gemini_door.answer, gemini_door.GenerateContentStream),
                "responses": DoorOracle(openai_door.answer, openai_door.ResponsesStream)}


def door_oracle(door: Door) -> DoorOracle:
    return DOOR_ORACLES[door.name]
