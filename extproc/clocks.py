"""Envoy's wall clock and ext_proc's. In a sidecar they are one host's clock; not always elsewhere (an
ext_proc service shared by a mesh's Envoys, a clock stepped by NTP, a test that moves the Python side's
calendar years ahead while Envoy keeps the real one). A time Envoy stamped (`request.time`) is used
against ext_proc's clock only while the two agree: otherwise a deadline or a duration would be off by
their difference, and a request refused as late that was not."""

from __future__ import annotations

import logging
from datetime import datetime

from extproc.ratelimit import RateLimitedLog

AHEAD_S = 1.0  # Envoy's stamp may lie this far in ext_proc's future (two hosts' clocks)
# ... and this far in its past: longer than any request waits for its first decision (a body's upload
# included; the default route deadline is 30 s), shorter than the skew it guards against.
BEHIND_S = 600.0

_skewed = RateLimitedLog(logging.getLogger("llmgw.clocks"), 60.0)


def envoy_stamp(stamp: str, now: float) -> float | None:
    """`stamp` (Envoy's RFC 3339 time) as seconds since the epoch, or None when it does not parse or
    disagrees with `now` (ext_proc's clock) beyond AHEAD_S/BEHIND_S: the caller then uses its own clock."""
    try:
        at = datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None
    if now - BEHIND_S <= at <= now + AHEAD_S:
        return at
    _skewed.warning("Envoy's clock and ext_proc's disagree by %.0f s: timing from ext_proc's own", now - at)
    return None
