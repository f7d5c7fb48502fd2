"""The request headers ext_proc reads, and how each is validated. Values arrive as text in which any
byte that was not UTF-8 is U+FFFD (extproc/wire.py); every validator here accepts printable ASCII
only, so such a value is refused like any other malformed one (never an exception)."""

from __future__ import annotations

import re

from extproc.contract import ErrorCode, GatewayError
from extproc.names import Header

AUTHORIZATION = "authorization"
IDEMPOTENCY_KEY = "idempotency-key"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

MAX_DEADLINE_MS = 86_400_000
_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only: str.isdigit() also takes "²"
_VISIBLE = re.compile(r"[\x21-\x7e]+")
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")


def visible_ascii(value: str) -> bool:
    return _VISIBLE.fullmatch(value) is not None


def deadline_ms(value: str | None) -> int | None:
    """The caller's remaining deadline; 400 unless 1..86,400,000 written in ASCII digits."""
    if value is None:
        return None
    if _DIGITS.fullmatch(value) is None or not 0 < int(value) <= MAX_DEADLINE_MS:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{Header.DEADLINE_MS} must be a positive integer of "
                           f"milliseconds (at most {MAX_DEADLINE_MS})", Header.DEADLINE_MS)
    return int(value)


def idempotency_key(value: str | None) -> str | None:
    """1-255 visible ASCII characters (what a client library generates), or 400."""
    if value is None:
        return None
    if not 0 < len(value) <= 255 or not visible_ascii(value):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "Idempotency-Key must be 1-255 visible ASCII characters",
                           "Idempotency-Key")
    return value


def trace_context(traceparent: str | None, tracestate: str | None) -> tuple[str, str]:
    """W3C Trace Context as the gateway continues it: a malformed traceparent is ignored (the trace
    restarts, as the specification asks), and tracestate only travels with a valid traceparent."""
    if traceparent is None or _TRACEPARENT.fullmatch(traceparent) is None:
        return "", ""
    if tracestate is None or _TRACESTATE.fullmatch(tracestate) is None:
        return traceparent, ""
    return traceparent, tracestate
