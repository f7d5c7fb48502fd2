"""The ledger and the decision log as the operations tools read them (one stream per tenant)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.store import ledger_entry, ledger_key

# Entries are appended when settled, after their arrival `time`, with the store's clock as their id: a
# read from a time starts this much earlier, for stores on hosts whose clocks differ from the gateway's.
CLOCK_SLACK_S = 60.0


def ledger_entries(client: Any, tenants: Sequence[str], since: float | None = None) -> list[dict[str, Any]]:
    """The ledger entries of these tenants, oldest first per tenant (read only: nothing acknowledged):
    every one, or those whose arrival `time` is at or after `since` (the stream read from there, not
    from its start: the ledger is unsampled and grows with every request)."""
    if since is None:
        return [ledger_entry(f) for t in tenants for _, f in client.xrange(ledger_key(t))]
    start = str(max(0, int((since - CLOCK_SLACK_S) * 1000)))
    entries = (ledger_entry(f) for t in tenants for _, f in client.xrange(ledger_key(t), min=start))
    return [e for e in entries if float(e.get("time") or 0) >= since]


def decision_entry(fields: dict[str, str]) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(fields.get("entry") or "{}")
    return entry


def ttft_ms(entry: Mapping[str, Any]) -> float | None:
    """An entry's time to first token, as every objective, report and canary judges it: a stream's
    first content token (`first_token_ms`, stamped by the stream guard; its headers came before the
    engine queued and prefilled), a JSON answer's first byte (generated whole before its headers).
    None when not known - and for a stream settled before the ledger had `first_token_ms`: its first
    byte was its headers, no time to first token."""
    value = entry.get("first_token_ms") if entry.get("stream") else entry.get("first_byte_ms")
    return None if value is None else float(value)
