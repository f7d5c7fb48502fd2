"""`llmgw ledger reconcile` (issue 14, part 5): the ledger's per-day totals of a deployment against its
provider's invoice - the simulated provider's own bill for what it served, over real HTTP - agree;
a seeded discrepancy in the bill is flagged and nothing else is; a day no invoice covers is an
estimate; the gateway's own FOCUS export reads as an invoice too."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from llmgw.local.stack import Stack
from llmgw.ops.reconcile import DayTotals, reconcile
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.helpers import request

D = "demo-anthropic"


def test_totals_must_agree_token_for_token_and_amounts_within_the_ledgers_rounding() -> None:
    ledger = {"2026-12-01": DayTotals(100, 20, 30, Decimal("0.000500"), entries=3)}
    same = {"2026-12-01": DayTotals(100, 20, 30, Decimal("0.000497"))}  # the ledger rounded 3 entries up
    assert reconcile(ledger, same, D).agrees
    off = reconcile(ledger, {"2026-12-01": DayTotals(100, 20, 31, Decimal("0.000497"))}, D)
    assert [(d.what, d.ledger, d.invoice) for d in off.differences] == [("output", "30", "31")]
    dear = reconcile(ledger, {"2026-12-01": DayTotals(100, 20, 30, Decimal("0.000400"))}, D)
    assert [d.what for d in dear.differences] == ["amount"]
    assert reconcile(ledger, {"2026-12-01": DayTotals(100, 20, 30, Decimal("0.000400"))}, D,
                     tolerance=Decimal("0.3")).agrees
    unbilled = reconcile(ledger, {}, D)
    assert unbilled.agrees and [d.what for d in unbilled.differences] == ["estimate"]
    unknown = reconcile({}, same, D)
    assert not unknown.agrees and [d.what for d in unknown.differences] == ["not_in_ledger"]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("reconcile"), simulate_providers=True)
    for i, stream in enumerate((False, True, False, True)):
        r = request(f"{s.url}/v1/chat/completions", "POST",
                    {"model": "chat-anthropic", "max_tokens": 7, "stream": stream,
                     "messages": [{"role": "user", "content": f"bill me {'abcd'[i]}"}]},
                    {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
        assert r.status == 200, r.body
        ledger_of(s, r.headers["x-request-id"], "acme")
    yield s
    s.stop()


def invoice(stack: Stack, path: Path, discrepancy: int | None = None) -> Path:
    (host, port), = stack.render.providers[D]
    p = stack.snapshot.deployments[D].prices
    query = (f"input_per_mtok={p.input_per_mtok}&cached_input_per_mtok={p.cached_input_per_mtok}"
             f"&output_per_mtok={p.output_per_mtok}&currency={p.currency}")
    if discrepancy is not None:
        query += f"&discrepancy={discrepancy}"
    r = request(f"http://{host}:{port}/admin/invoice?{query}")
    assert r.status == 200
    path.write_bytes(r.body)
    return path


def reconcile_cmd(stack: Stack, bill: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ledger", "reconcile", "--config", str(stack.opts.config_dir),
                           "--store-url", str(stack.store_url), "--deployment", D, "--invoice", str(bill)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.e2e
def test_the_ledger_agrees_with_the_providers_invoice(up: Stack, tmp_path: Path) -> None:
    bill = invoice(up, tmp_path / "invoice.csv")
    assert bill.read_text().count("\n") == 2  # a header and one day
    r = reconcile_cmd(up, bill)
    assert r.returncode == 0 and "agree" in r.stdout, r.stdout + r.stderr


@pytest.mark.e2e
def test_a_seeded_discrepancy_is_flagged_and_nothing_else(up: Stack, tmp_path: Path) -> None:
    r = reconcile_cmd(up, invoice(up, tmp_path / "invoice.csv", discrepancy=7))
    assert r.returncode == 1
    flagged = [line for line in r.stdout.splitlines() if ": ledger " in line]
    assert len(flagged) == 2, r.stdout  # the output tokens, and the amount they bill
    assert "output: ledger" in flagged[0] and "amount: ledger" in flagged[1]


@pytest.mark.e2e
def test_the_gateways_focus_export_reads_as_an_invoice(up: Stack, tmp_path: Path) -> None:
    focus = tmp_path / "focus.csv"
    subprocess.run([sys.executable, "-m", "llmgw", "ledger", "export", "--config", str(up.opts.config_dir),
                    "--store-url", str(up.store_url), "--format", "focus", "--consumer", "reconcile", "-o", str(focus)],
                   check=True, capture_output=True, timeout=60)
    r = reconcile_cmd(up, focus)
    assert r.returncode == 0 and "agree" in r.stdout, r.stdout + r.stderr
