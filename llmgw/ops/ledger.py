"""The ledger and the decision log as the operations tools read them (one stream per tenant)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from extproc.store import ledger_entry, ledger_key


def ledger_entries(client: Any, tenants: Sequence[str]) -> list[dict[str, Any]]:
    """Every ledger entry of these tenants, oldest first per tenant (read only: nothing acknowledged)."""
    return [ledger_entry(f) for t in tenants for _, f in client.xrange(ledger_key(t))]


def decision_entry(fields: dict[str, str]) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(fields.get("entry") or "{}")
    return entry
