"""The request fields current OpenAI clients and frameworks send that concern the gateway rather than a
model: each decided here, once (docs/FIELDS.md is the table users read).

  owned     the gateway answers it itself: checked, acted on or recorded, and taken out of the request
            before any stage after intake sees it (no candidate receives it)
  refused   400 `unsupported_field` with the reason, for every route

Fields that a model answers (`reasoning_effort`, `verbosity`, sampling, tools) stay in the request and
each adapter's loss table says what its candidates do with them (extproc/shapes/*/adapter.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from extproc.contract import ErrorCode, GatewayError

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's own bounds


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def _refuse(param: str, why: str) -> GatewayError:
    return GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{param}` {why}", param)


def _store(v: Any, param: str) -> None:
    if not isinstance(v, bool):
        raise _invalid(f"`{param}` must be a boolean", param)
    if v:
        raise _refuse(param, "true is not offered: the gateway keeps no completions at a provider; what is "
                             "logged is the route's logging policy")


def _metadata(v: Any, param: str) -> None:
    if not isinstance(v, dict) or len(v) > MAX_METADATA_PAIRS:
        raise _invalid(f"`{param}` must be an object of at most {MAX_METADATA_PAIRS} pairs", param)
    for k, val in v.items():
        if len(k) > MAX_METADATA_KEY or not isinstance(val, str) or len(val) > MAX_METADATA_VALUE:
            raise _invalid(f"`{param}` keys are at most {MAX_METADATA_KEY} characters and values strings of "
                           f"at most {MAX_METADATA_VALUE}", f"{param}.{k}")


def _service_tier(v: Any, param: str) -> None:
    if v not in ("auto", "default"):
        raise _refuse(param, f"{v!r} is not offered: every candidate serves the default tier (auto and "
                             "default are accepted)")


def _modalities(v: Any, param: str) -> None:
    if not isinstance(v, list) or not all(isinstance(m, str) for m in v):
        raise _invalid(f"`{param}` must be an array of strings", param)
    if any(m != "text" for m in v):
        raise _refuse(param, "other than text is not offered")


def _short(v: Any, param: str) -> None:
    if not isinstance(v, str) or len(v) > 256:
        raise _invalid(f"`{param}` must be a string of at most 256 characters", param)


# Each owned field's check; what the gateway then does with it is in `take` and docs/FIELDS.md.
OWNED: dict[str, Callable[[Any, str], None]] = {
    "store": _store,  # false accepted (nothing is stored at a provider), true refused
    "metadata": _metadata,  # recorded in the ledger entry (log-safe), never sent upstream
    "service_tier": _service_tier,  # auto and default accepted; flex, scale and priority refused
    "modalities": _modalities,  # ["text"] accepted; audio refused
    # accepted, not sent: prefix caches are kept per tenant (cache_salt), requests routed by prefix already
    "prompt_cache_key": _short,
    "safety_identifier": _short,  # the end user's identifier: carried as `user` (its replacement)
}

REFUSED: dict[str, str] = {
    "prediction": "(predicted outputs) is not offered: no engine behind the gateway takes it",
    "web_search_options": "is not offered: the gateway runs no search tool; offer one as a tool",
    "audio": "is not offered: the gateway carries text and images",
}


@dataclass
class ClientFields:
    """What intake took out of a request (only the parts later stages need)."""

    metadata: dict[str, str] = field(default_factory=dict)


def take(body: dict[str, Any]) -> ClientFields:
    """Checks and removes the owned fields of a request (refusing what no route takes); returns what
    the ledger records. A null field asks for nothing."""
    for name, why in REFUSED.items():
        if body.pop(name, None) is not None:
            raise _refuse(name, why)
    out = ClientFields()
    for name, check in OWNED.items():
        value = body.pop(name, None)
        if value is None:
            continue
        check(value, name)
        if name == "metadata":
            out.metadata = dict(value)
        elif name == "safety_identifier":
            if body.get("user") not in (None, value):
                raise _invalid("`safety_identifier` and `user` name different end users", "safety_identifier")
            body["user"] = value
    return out
