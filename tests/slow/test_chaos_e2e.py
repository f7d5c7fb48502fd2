"""`llmgw chaos` end to end: the whole fault table against a real gateway (Envoy, two ext_proc workers,
Valkey, simulated engines and provider), every invariant holding after every fault, exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.chaos.checks import INVARIANTS
from llmgw.chaos.inject import FAULTS
from tests.helpers import llmgw

pytestmark = pytest.mark.e2e


@pytest.mark.serial  # faults timed against requests in flight
def test_every_fault_of_the_table_holds_every_invariant(tmp_path: Path) -> None:
    table = tmp_path / "chaos.md"
    run = llmgw("chaos", "--work-dir", str(tmp_path / "work"), "--output", str(table), timeout=600)
    print(run.stdout, run.stderr[-3000:])
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = [line.strip("| ").split(" | ") for line in table.read_text().splitlines()[2:] if line.startswith("| ")]
    assert [r[0] for r in rows] == [f.name for f in FAULTS]
    for r in rows:
        assert r[2:] == ["ok"] * len(INVARIANTS) + ["yes"], r
