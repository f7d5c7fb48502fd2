"""The OpenAI shape's answer side in Python (extproc/shapes/openai/adapter.py has its request side):
its answers are already the internal shape - checked, passed as they came (extproc/shapes/openai/
answers.lua in production) - and its errors read by status."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from extproc.contract import ErrorCode
from extproc.shapes.openai.adapter import OPENAI as _OPENAI
from tests.oracles.base import Failure, Oracle, UpstreamBroken, Usage, token_count


def response(status: int, body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise UpstreamBroken("the upstream's answer is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        raise UpstreamBroken("the upstream's answer is not a chat completion")
    return doc


def stream(include_usage: bool = True) -> PassThrough:
    return PassThrough()


def failure(status: int, body: bytes) -> Failure:
    message = ""
    try:
        err = json.loads(body).get("error") or {}
        message = str(err.get("message", ""))[:500] if isinstance(err, dict) else ""
    except (ValueError, AttributeError):
        pass
    return failure_for_status(status, message)


def usage(native: Mapping[str, Any]) -> Usage:
    """The internal usage's counts, each part at most what is left of its whole (as
    extproc/lua/doors.lua's `internal_usage` and extproc/settlement/charge.py's `token_classes` read them)."""
    details = native.get("prompt_tokens_details") or {}
    out_details = native.get("completion_tokens_details") or {}
    prompt, output = token_count(native.get("prompt_tokens")), token_count(native.get("completion_tokens"))
    cached = min(prompt, token_count(details.get("cached_tokens")))
    write = min(prompt - cached, token_count(details.get("cache_write_tokens")))
    write_1h = min(prompt - cached - write, token_count(details.get("cache_write_1h_tokens")))
    return Usage(prompt, cached, output, min(output, token_count(out_details.get("reasoning_tokens"))),
                 cache_write=write, cache_write_1h=write_1h)


def failure_for_status(status: int, message: str) -> Failure:
    """What an HTTP status means to the contract, whatever the shape (the body refines it)."""
    why = message or f"the upstream answered {status}"
    if status == 429:
        # The provider's limit, not the gateway's: 429 `rate_limited` is the gateway's own quota
        # refusal (the contract's table); a provider's refusal of every attempt is `upstream_error`.
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "rate_limited")
    if status == 529:
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "overloaded")
    if status in (502, 503, 504):
        return Failure(ErrorCode.UPSTREAM_ERROR, 502, why, "unavailable")
    return Failure(ErrorCode.UPSTREAM_ERROR, 502, why)


class PassThrough:
    """The pool's streams are already the internal shape (Envoy's Lua guard checks them)."""

    def feed(self, chunk: bytes) -> list[bytes]:
        return [chunk] if chunk else []

    def finish(self) -> list[bytes]:
        return []


OPENAI = Oracle(_OPENAI, response, lambda include_usage=True: PassThrough(), failure, usage)
