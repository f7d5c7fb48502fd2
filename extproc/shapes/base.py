"""What every adapter shares: the values that cross the adapter boundary, and the protocol."""


from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.shapes.loss import Loss, LossTable

MAX_COUNT = 2**53  # no upstream counts more tokens than this for one request


def is_count(value: Any) -> bool:
    """Whether a value is a token count an upstream gives: a whole number from 0 to 2^53. A negative
    one would refund a budget, a huge one drain it, and `2.5`, `"7"` or `true` read as one would
    charge what the upstream never said."""
    return (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
            and value == int(value))


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


class Adapter(Protocol):
    """A shape's request side, which production runs in ext_proc. Its answer side (answers, streams,
    errors, usage) runs in Envoy's Lua; its Python twin is the tests' (tests/oracles/)."""

    name: str
    version: int
    loss_table: LossTable

    def endpoint(self, target: Target) -> tuple[str, dict[str, str]]: ...

    def request(self, body: Mapping[str, Any], target: Target) -> NativeRequest: ...

    def counts(self, target: Target) -> bool:
        """Whether the target can count a prompt's tokens (its provider's own count, or the engine's
        tokenizer)."""
        ...

    def count_request(self, body: Mapping[str, Any], target: Target) -> NativeRequest:
        """The request that counts the prompt's tokens as a target that `counts` would."""
        ...


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
