"""Intake: the request must be a chat completion with a well-formed JSON body (400 otherwise)."""

from __future__ import annotations

import json
from typing import Any

from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange

CHAT_PATH = "/v1/chat/completions"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def _check_messages(messages: Any, limit: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise _invalid("`messages` must be a non-empty array", "messages")
    if len(messages) > limit:
        raise _invalid(f"`messages` holds more than {limit} entries", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _invalid(f"messages[{i}] needs a `role` of {sorted(_ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _invalid(f"messages[{i}].content must be a string or an array of parts",
                           f"messages[{i}].content")


def _check_int(body: dict[str, Any], name: str) -> None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise _invalid(f"`{name}` must be a positive integer", name)


class Intake:
    name = "intake"

    async def run(self, ex: Exchange) -> None:
        if ex.path.split("?", 1)[0] != CHAT_PATH:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, f"no such endpoint: {ex.method} {ex.path}")
        if ex.method != "POST":
            raise _invalid(f"{CHAT_PATH} takes POST")
        try:
            body = json.loads(ex.raw_body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _invalid(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _invalid("request body must be a JSON object")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _invalid("`model` must name a route", "model")
        _check_messages(body.get("messages"), ex.snapshot.gateway.limits.max_messages)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _invalid("`stream` must be a boolean", "stream")
        _check_int(body, "max_tokens")
        _check_int(body, "max_completion_tokens")
        ex.body = body
        ex.stream = stream
