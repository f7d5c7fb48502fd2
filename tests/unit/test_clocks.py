"""Envoy's `request.time` is used against ext_proc's clock only while the two agree (extproc/clocks.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from extproc.clocks import AHEAD_S, BEHIND_S, envoy_stamp

NOW = datetime(2026, 12, 3, 9, 0, tzinfo=UTC).timestamp()


def stamp(offset_s: float) -> str:
    return datetime.fromtimestamp(NOW + offset_s, UTC).isoformat()


@pytest.mark.parametrize(("given", "expected"), [
    (stamp(0), NOW),
    (stamp(-0.25), NOW - 0.25),  # Envoy received it a moment before ext_proc heard of it
    (stamp(-30), NOW - 30),  # a slow upload before a buffered body's decision
    (stamp(AHEAD_S / 2), NOW + AHEAD_S / 2),  # two hosts' clocks, a little apart
    (stamp(AHEAD_S + 1), None),  # Envoy's clock ahead of ours
    (stamp(-BEHIND_S - 1), None),  # ... or far behind: a skew, not a wait
    (stamp(-2 * 365 * 86400), None),  # ext_proc's calendar two years ahead of Envoy's
    ("not a time", None),
    ("", None),
])
def test_envoy_stamps_are_trusted_only_near_our_clock(given: str, expected: float | None) -> None:
    got = envoy_stamp(given, NOW)
    assert got == pytest.approx(expected) if expected is not None else got is None
