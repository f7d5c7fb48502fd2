"""`llmgw plan` (issue 15, part 6): the cost-per-token figures from the built-in price table, and the
planning bound's arithmetic - g_min, reserves, the allocation unit, stability - on a hand example."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmgw.ops.plan import (
    CAPACITY_BLOCK_USD,
    Hosted,
    Reserves,
    Workload,
    accelerators_min,
    cost_per_million_tokens,
    plan_scenario,
)
from tests.conftest import POLICY
from tests.helpers import llmgw


def test_the_seed_s_p5_figures_come_from_its_price_table() -> None:
    assert CAPACITY_BLOCK_USD["P5"] == 5.970
    # "About 1.11 at full utilisation and 3.68 at 30%": 1.1056 and 3.6852.
    assert round(cost_per_million_tokens(5.970, 1500, 1.0), 3) == 1.106
    assert round(cost_per_million_tokens(5.970, 1500, 0.3), 3) == 3.685
    out = llmgw("plan", "--price-per-accelerator-hour", "5.970", "--tokens-per-second", "1500", "--utilization", "0.3")
    assert out.returncode == 0, out.stderr
    assert "1.106 USD at full utilisation, 3.685 USD at 30% utilisation" in out.stdout, out.stdout
    by_table = llmgw("plan", "--instance", "P5", "--utilization", "0.3")
    assert "P5 Capacity Block rate effective 2026-10-07" in by_table.stdout and "3.685 USD" in by_table.stdout


def test_the_bound_reserves_and_allocation_unit_on_a_hand_example() -> None:
    assert accelerators_min(10, 2.0, 0.7) == 29  # ceil(20 / 0.7 = 28.57)
    assert accelerators_min(7, 1.0, 0.7) == 10  # exactly 10: not rounded up past it
    with pytest.raises(ValueError):
        accelerators_min(1, 1, 1.0)
    base = plan_scenario("base", 1.0, Workload(10, 2.0, 1000, 250), Reserves(0.7, 0.2, 1, 8), 5.970,
                         Hosted("h", 3.0, 15.0))
    # 29 * 1.2 = 34.8 -> 5 units of 8 = 40 serving, + 1 unit for failures = 48 billed
    assert (base.g_min, base.provisioned, base.service_rps, base.stable) == (29, 48, 20.0, True)
    assert base.accepted_per_day == 10 * 86_400 and base.refused_per_day == 0
    busy = 10 * 86_400 * 2.0 / 3600  # 480 accelerator-hours
    assert math.isclose(base.utilization, busy / (48 * 24))
    assert math.isclose(base.cost_per_day, 48 * 24 * 5.970)
    assert math.isclose(base.hosted_cost_per_day or 0, 864_000 * (1000 * 3.0 + 250 * 15.0) / 1e6)
    # Demand past what is provisioned: mu_g caps what is accepted; the rest is refused, not queued.
    surge = plan_scenario("surge", 3.0, Workload(10, 2.0, 1000, 250), Reserves(0.7, 0.2, 1, 8), 5.970)
    assert surge.stable  # sized for its own peak
    undersized = plan_scenario("x", 1.0, Workload(10, 2.0, 1000, 250), Reserves(0.99, 0.0, 0, 1), 5.970)
    assert undersized.g_min == 21 and undersized.service_rps == 10.5 and undersized.stable


def test_the_command_prices_low_base_high_beside_the_demo_s_hosted_route() -> None:
    out = llmgw("plan", "--instance", "P5", "--peak-rps", "20", "--input-tokens", "1000", "--output-tokens", "250",
                "--hosted-route", "chat-anthropic", "--config", str(POLICY))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| low", "| base", "| high"))]
    assert len(rows) == 3
    assert all(row.split("|")[6].strip() == "yes" for row in rows)  # stable
    # The eligible hosted candidate cheapest per accepted task, its prices over its quality score.
    assert "hosted: chat-anthropic (demo-anthropic, prices 2026-12.2, USD, quality 1.00)" in out.stdout
    assert "SLO attainment: not measured" in out.stdout
    missing = llmgw("plan", "--peak-rps", "1", "--hosted-route", "no-such-route")
    assert missing.returncode == 2 and "no route no-such-route" in missing.stderr


def test_a_sweep_gives_e_s_and_rho_max(tmp_path: Path) -> None:
    """E[S] = accelerators / mu from the sweep, rho_max = its utilisation at the SLO: 20 req/s at
    E[S] = 2 / 8 = 0.25 s under rho_max 0.75 needs ceil(20 x 0.25 / 0.75) = 7 accelerators."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"mu_rps": 8.0, "knee_rps": 6.0, "slo_utilization": {"chat-default": 0.75}}))
    out = llmgw("plan", "--peak-rps", "20", "--sweep", str(sweep), "--sweep-accelerators", "2")
    assert out.returncode == 0, out.stderr
    assert "E[S] = 0.25 accelerator-seconds per request (measured by the sweep: 2 accelerator(s) / mu 8" in out.stdout
    assert "rho_max 0.75" in out.stdout
    base = next(line for line in out.stdout.splitlines() if line.startswith("| base"))
    assert base.split("|")[3].strip() == "7"  # g_min
    assert "the gate held up to 75% utilisation" in out.stdout
    given = llmgw("plan", "--peak-rps", "20", "--sweep", str(sweep), "--sweep-accelerators", "2", "--rho-max", "0.5")
    assert "rho_max 0.5" in given.stdout and "given: 0.5" in given.stdout
    sweep.write_text(json.dumps({"mu_rps": 0, "slo_utilization": {}}))
    empty = llmgw("plan", "--peak-rps", "20", "--sweep", str(sweep))
    assert empty.returncode == 2 and "completed no requests" in empty.stderr
