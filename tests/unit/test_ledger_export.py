"""`llmgw ledger export` into a file is exactly once: an export that dies after writing a batch and
before acknowledging it (or whose acknowledgement a store failover lost) leaves the batch pending; the
next export finds it in the output and only acknowledges it. Against a real Valkey."""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.store import ledger_key, packed
from llmgw.cli import ledger as ledger_cmd
from tests.conftest import POLICY, valkey_url


class DiesAtFirstAck:
    """The store client of an export whose process dies right after writing its first batch."""

    def __init__(self, client: Any):
        self.client, self.acked = client, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def xack(self, *args: Any) -> Any:
        if not self.acked:
            self.acked = True
            raise SystemExit("killed between the write and the acknowledgement")
        return self.client.xack(*args)


def export(out: Path, tenant: str, fmt: str, monkeypatch: pytest.MonkeyPatch, dies: bool = False) -> None:
    real = redis.Redis.from_url(valkey_url(), decode_responses=True)
    monkeypatch.setattr(ledger_cmd, "store_client", lambda url: DiesAtFirstAck(real) if dies else real)
    args = argparse.Namespace(config=str(POLICY), state_dir=".llmgw", store_url=valkey_url(), tenant=tenant,
                              decisions=False, format=fmt, period="day", output=str(out), consumer="cli")
    assert ledger_cmd.cmd_export(args) == 0


@pytest.mark.parametrize("fmt", ["jsonl", "focus"])
def test_an_export_killed_between_write_and_ack_exports_nothing_twice(tmp_path: Path, fmt: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = f"export{time.time_ns()}"
    client = redis.Redis.from_url(valkey_url(), decode_responses=True)
    for i in range(5):
        client.xadd(ledger_key(tenant), {
            "record": packed({"request_id": f"r{i}", "tenant": tenant, "route": "chat-default", "time": time.time(),
                              "price_version": "2026-11", "stream": i % 2 == 1}).decode(),
            "outcome": packed({"attempts": [{"deployment": "pool-llama-8b"}], "usage": {
                "prompt_tokens": 10, "completion_tokens": 5}}).decode(),
            "reserved_micros": 100, "reserved_tokens": 20, "charged_micros": 40, "charged_tokens": 15})
    out = tmp_path / f"ledger.{fmt}"
    with pytest.raises(SystemExit):
        export(out, tenant, fmt, monkeypatch, dies=True)
    pending = client.xpending(ledger_key(tenant), ledger_cmd.GROUP)["pending"]
    assert pending == 5 and out.stat().st_size > 0  # written, never acknowledged
    export(out, tenant, fmt, monkeypatch)
    export(out, tenant, fmt, monkeypatch)  # and again: nothing new
    assert client.xpending(ledger_key(tenant), ledger_cmd.GROUP)["pending"] == 0
    if fmt == "jsonl":
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [d["request_id"] for d in lines] == [f"r{i}" for i in range(5)]
        # The record's own `stream` (did the request stream?) survives the export's position fields.
        assert [d["stream"] for d in lines] == [i % 2 == 1 for i in range(5)]
        assert {d["export_stream"] for d in lines} == {ledger_key(tenant)} and all(d["export_id"] for d in lines)
    else:
        rows = list(csv.DictReader(out.open()))
        assert sum(int(r["x_ledger_entries"]) for r in rows) == 5  # each entry counted once, on one row
        assert sum(float(r["ConsumedQuantity"]) for r in rows if r["ChargeDescription"].startswith("output")) == 25
