"""`llmgw ledger export --format focus` (issue 14, part 4): the ledger as FOCUS cost rows, checked by
the `focus-validator` package (its own environment, `.venv-focus`, made by `make test`), amounts that
sum to exactly what the ledger charged, and exports that are incremental and exactly-once."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis

from extproc.config import load_snapshot
from extproc.settlement.charge import charge_of
from extproc.store import ledger_entry, ledger_key
from llmgw.local.stack import Stack
from llmgw.ops.focus import FOCUS_VERSION, aggregate, record
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import request

ROOT = Path(__file__).resolve().parents[3]
VALIDATOR = ROOT / ".venv-focus/bin/focus-validator"
SNAP = load_snapshot(POLICY)
DEP = SNAP.deployments["pool-llama-8b"]


def validate(path: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """focus-validator on `path`. It reads its currency codes from a path relative to the working
    directory (its site-packages), and its 1.0 rule for SkuPriceId queries `ChargeType`, a column
    FOCUS 1.0 renamed `ChargeCategory`: that one rule is overridden here and checked by the tests."""
    assert VALIDATOR.exists(), "the FOCUS validator is installed by `make test` (.venv-focus)"
    site = next((ROOT / ".venv-focus/lib").glob("python3*/site-packages"))
    override = tmp / "override.yaml"
    override.write_text("overrides:\n  - SkuPriceId_Nullable\n")
    return subprocess.run([str(VALIDATOR), "--data-file", str(path), "--validate-version", FOCUS_VERSION,
                           "--column-namespace", "x", "--override-file", str(override)],
                          capture_output=True, text=True, cwd=site, timeout=120)


def entry(charged: int, prompt: int = 0, cached: int = 0, output: int = 0, version: str | None = None,
          time: float = 1796130000.0, usage: bool = True) -> dict[str, Any]:
    return {"time": time, "tenant": "acme", "route": "chat-default", "route_revision": "r1",
            "price_version": version or DEP.prices.version, "charged_micros": charged,
            "usage": {"prompt_tokens": prompt, "completion_tokens": output,
                      "prompt_tokens_details": {"cached_tokens": cached}} if usage else None,
            "attempts": [{"deployment": DEP.deployment}]}


def test_each_token_class_is_a_row_and_the_rows_sum_to_what_the_ledger_charged() -> None:
    entries = [entry(5, prompt=11, cached=3, output=5), entry(9, prompt=20, output=9),
               entry(0, prompt=4, output=0)]  # charged nothing (released): no row
    rows = aggregate(entries, SNAP)
    assert [r.key[-1] for r in rows] == ["cached_input", "input", "output"]
    assert {r.key[-1]: r.tokens for r in rows} == {"input": 8 + 20, "cached_input": 3, "output": 14}
    assert sum(r.billed for r in rows) == Decimal(5 + 9) / 1_000_000  # exactly, rounding included
    p = DEP.prices
    assert rows[1].list_cost == Decimal(28 * p.input_per_mtok) / Decimal(10) ** 12
    assert rows[0].entries + rows[1].entries + rows[2].entries == 2  # each entry counted once


def test_cache_writes_and_reasoning_are_rows_at_their_own_rates() -> None:
    """An Anthropic-priced deployment: writes at 5 minutes and 1 hour, reads and reasoning each a row at
    the deployment's rate for it; the rows still sum to what the ledger charged."""
    dep = SNAP.deployments["demo-anthropic"]
    usage = {"prompt_tokens": 1000, "completion_tokens": 100, "prompt_tokens_details": {
        "cached_tokens": 500, "cache_write_tokens": 200, "cache_write_1h_tokens": 100},
        "completion_tokens_details": {"reasoning_tokens": 40}}
    micros = charge_of(usage, dep.prices)[0]
    e = {**entry(micros), "usage": usage, "price_version": dep.prices.version,
         "attempts": [{"deployment": dep.deployment}]}
    rows = {r.key[-1]: r for r in aggregate([e], SNAP)}
    assert {c: r.tokens for c, r in rows.items()} == {"input": 200, "cached_input": 500, "cache_write": 200,
                                                      "cache_write_1h": 100, "output": 60, "reasoning": 40}
    assert rows["cache_write_1h"].unit_price == Decimal(dep.prices.per_mtok("cache_write_1h")) / Decimal(10) ** 12
    assert rows["cache_write"].unit_price != rows["input"].unit_price  # priced apart, not as input
    assert sum(r.billed for r in rows.values()) == Decimal(micros) / 1_000_000


def test_unmetered_and_repriced_entries_keep_their_charge() -> None:
    rows = aggregate([entry(21, usage=False), entry(7, prompt=10, output=2, version="2025-01")], SNAP)
    by_class = {r.key[-1]: r for r in rows}
    assert by_class["unmetered"].billed == Decimal(21) / 1_000_000 and by_class["unmetered"].tokens == 0
    assert by_class["tokens"].billed == Decimal(7) / 1_000_000 and by_class["tokens"].tokens == 12
    assert record(by_class["unmetered"], "day")["ConsumedQuantity"] == ""  # no quantity to claim


def test_an_attempt_charged_at_its_bound_is_a_row_of_its_own() -> None:
    """Attempts sent and never answered before the answer (invariant 23): their charge is a row of its
    own, never folded into the answer's classes as rounding; the rows still sum to the charge."""
    e = entry(5 + 2 * 3, prompt=11, output=5)
    e["attempts"] = [{"n": 1, "status": 0, "settlement": "unknown", "charged_micros": 3, "charged_tokens": 16},
                     {"n": 2, "status": 503, "settlement": "released", "charged_micros": 0, "charged_tokens": 0},
                     {"n": 3, "status": 0, "settlement": "unknown", "charged_micros": 3, "charged_tokens": 16},
                     {"deployment": DEP.deployment, "n": 4, "status": 200}]
    rows = {r.key[-1]: r for r in aggregate([e], SNAP)}
    assert set(rows) == {"input", "output", "unanswered_attempt"}
    assert (rows["unanswered_attempt"].billed, rows["unanswered_attempt"].tokens) == (Decimal(6) / 1_000_000, 32)
    assert rows["unanswered_attempt"].key[4] == DEP.deployment and rows["unanswered_attempt"].unit_price is None
    assert rows["input"].billed + rows["output"].billed == Decimal(5) / 1_000_000
    assert sum(r.billed for r in rows.values()) == Decimal(11) / 1_000_000


def test_periods_split_days_or_hours() -> None:
    two = [entry(5, prompt=4, output=1, time=1796130000.0), entry(5, prompt=4, output=1, time=1796130000.0 + 7200)]
    assert len({r.key[0] for r in aggregate(two, SNAP, "hour")}) == 2
    assert len({r.key[0] for r in aggregate(two, SNAP, "day")}) == 1
    rec = record(aggregate(two, SNAP, "hour")[0], "hour")
    assert rec["ChargePeriodStart"] == "2026-12-01T13:00:00Z" and rec["ChargePeriodEnd"] == "2026-12-01T14:00:00Z"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("focus"))
    yield s
    s.stop()


def ask(stack: Stack, text: str, stream: bool = False) -> str:
    r = request(f"{stack.url}/v1/chat/completions", "POST",
                {"model": "chat-default", "max_tokens": 6, "stream": stream,
                 "messages": [{"role": "user", "content": text}]}, {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert r.status == 200, r.body
    ledger_of(stack, r.headers["x-request-id"], "acme")  # settled
    return r.headers["x-request-id"]


def export(stack: Stack, out: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "llmgw", "ledger", "export", "--config", str(stack.opts.config_dir),
                        "--store-url", str(stack.store_url), "--format", "focus", "-o", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stderr


def charged_total(stack: Stack) -> int:
    r = redis.Redis.from_url(str(stack.store_url), decode_responses=True)
    fields: Any = r.xrange(ledger_key("acme"))
    return sum(ledger_entry(f)["charged_micros"] for _, f in fields)


@pytest.mark.e2e
def test_the_export_passes_the_focus_validator_and_is_exactly_once(stack: Stack, tmp_path: Path) -> None:
    for i, stream in enumerate((False, True, False)):
        ask(stack, f"focus export request {'abcd'[i]}", stream)
    out = tmp_path / "focus.csv"
    assert "as FOCUS 1.0 rows" in export(stack, out)
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert rows and all(r["x_focus_version"] == FOCUS_VERSION and r["SkuPriceId"] for r in rows)
    assert sum(Decimal(r["BilledCost"]) for r in rows) == Decimal(charged_total(stack)) / 1_000_000
    assert sum(int(r["x_ledger_entries"]) for r in rows) == 3
    v = validate(out, tmp_path)
    assert "Validation succeeded" in v.stdout + v.stderr, v.stdout + v.stderr
    # Exactly once: a second export adds nothing; a new request's rows come next, under one header.
    assert "exported 0 record(s)" in export(stack, out)
    ask(stack, "focus export request later")
    assert "exported 1 record(s)" in export(stack, out)
    text = out.read_text()
    assert text.count("BilledCost,") == 1
    later = list(csv.DictReader(io.StringIO(text)))[len(rows):]
    assert later and sum(int(r["x_ledger_entries"]) for r in later) == 1
    assert "Validation succeeded" in validate(out, tmp_path).stdout


@pytest.mark.e2e
def test_the_validator_catches_a_row_that_breaks_focus(stack: Stack, tmp_path: Path) -> None:
    ask(stack, "focus export request broken")
    out = tmp_path / "focus.csv"
    export(stack, out)
    broken = tmp_path / "broken.csv"
    broken.write_text(out.read_text().replace(",Usage-Based,", ",Sometimes,"))
    v = validate(broken, tmp_path)
    assert "ChargeFrequency" in v.stdout and "Validation failed" in v.stdout + v.stderr
