"""The ledger and the decision log as the operations tools read them (one stream per tenant)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.store import idem_key, idempotency_key_sha256, ledger_entry, ledger_key
from extproc.store.scripts import FORGET_AMBIGUOUS

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


def entries_of(client: Any, tenants: Sequence[str], request_id: str = "",
               idempotency_key: str = "") -> list[dict[str, Any]]:
    """The ledger entries of one request (by its id) or of every request sent with one Idempotency-Key,
    oldest first: a scan of the tenants' streams (an operator's question, not the request path's)."""
    sha = idempotency_key_sha256(idempotency_key) if idempotency_key else ""
    return [e for e in ledger_entries(client, tenants)
            if (request_id and e.get("request_id") == request_id)
            or (sha and e.get("idempotency_key_sha256") == sha)]


def key_state(client: Any, tenant: str, idempotency_key: str) -> dict[str, str]:
    """What the store holds of an Idempotency-Key now: its state (inflight, done, ambiguous) and the
    request that holds it ({} when the store keeps nothing: never used, forgotten or expired)."""
    held = client.hgetall(idem_key(tenant, idempotency_key_sha256(idempotency_key)))
    return {"state": held["state"], "request_id": held.get("rid", "")} if held.get("state") else {}


def forget_ambiguous(client: Any, tenant: str, idempotency_key: str) -> str:
    """An operator's resolution of a key left ambiguous: forgotten, so a retry with it runs. The state
    found is returned; any other state is left as it is (a key in flight or done is not the operator's)."""
    found = client.eval(FORGET_AMBIGUOUS, 1, idem_key(tenant, idempotency_key_sha256(idempotency_key)))
    return str(found.decode() if isinstance(found, bytes) else found)
