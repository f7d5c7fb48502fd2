"""Metric families that need no running gateway: the per-tenant families (only where gateway.yaml's
`metrics.tenant_label` is on) and the store's gauges as read at scrape time (extproc/occupancy.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import REGISTRY

from extproc.config import load_snapshot
from extproc.occupancy import families
from extproc.settlement.charge import Timing
from extproc.settlement.observe import SettledRequest, observer
from extproc.stages.budget import window_id
from extproc.store import BudgetUse, Occupancy, budget_key
from tests.conftest import POLICY


def _settled(tenant: str) -> SettledRequest:
    outcome = {"termination": "complete", "settlement": "actual",
               "usage": {"prompt_tokens": 7, "completion_tokens": 5}}
    return SettledRequest(None, "chat-units", False, 200, outcome, "rid", "", "rev", None, Timing(0.1, 0.05),
                          tenant)


def test_per_tenant_families_count_only_where_the_tenant_is_given() -> None:
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = sample("llmgw_tenant_settlements_total", tenant="units", route="chat-units", termination="complete")
    tokens = sample("llmgw_tenant_tokens_total", tenant="units", gen_ai_token_type="output")
    observer(_settled(""))()  # tenant_label off: the settlement carries no tenant
    assert sample("llmgw_tenant_settlements_total", tenant="", route="chat-units", termination="complete") == 0
    observer(_settled("units"))()
    assert sample("llmgw_tenant_settlements_total", tenant="units", route="chat-units",
                  termination="complete") == before + 1
    assert sample("llmgw_tenant_tokens_total", tenant="units", gen_ai_token_type="output") == tokens + 5


def test_the_store_gauges_say_what_is_held_and_what_remains() -> None:
    snap = load_snapshot(POLICY)
    now = datetime.now(UTC)
    key = budget_key("acme", "acme-monthly", window_id("monthly", now)[0])
    held = Occupancy(leases={"acme": 2, "globex": 1}, inflight_tokens={"acme": 300, "globex": 0},
                     budgets={key: BudgetUse(reserved_micros=40, settled_micros=1_000, reserved_tokens=30,
                                             settled_tokens=900)})
    by_name = {m.name: m for m in families(snap, held, tenant_label=False)}
    assert [s.value for s in by_name["llmgw_store_up"].samples] == [1]
    assert [s.value for s in by_name["llmgw_reservations_open"].samples] == [3]
    assert [s.value for s in by_name["llmgw_inflight_tokens"].samples] == [300]
    remaining = {tuple(s.labels.values()): s.value for s in by_name["llmgw_budget_remaining"].samples}
    assert remaining == {("acme-monthly", "micros"): 100_000_000 - 1_040}  # acme-monthly has no token limit
    reserved = {tuple(s.labels.values()): s.value for s in by_name["llmgw_budget_reserved"].samples}
    assert reserved == {("acme-monthly", "micros"): 40, ("acme-monthly", "tokens"): 30}
    assert "llmgw_tenant_reservations_open" not in by_name
    per_tenant = {m.name: m for m in families(snap, held, tenant_label=True)}["llmgw_tenant_reservations_open"]
    assert {s.labels["tenant"]: s.value for s in per_tenant.samples} == {"acme": 2, "globex": 1}
    # A store that did not answer: llmgw_store_up at 0 and no stale store figures (the revision's own
    # voided evidence still counts: it is no store fact).
    down, voided = families(snap, None, tenant_label=False)
    assert (down.name, [s.value for s in down.samples]) == ("llmgw_store_up", [0])
    assert (voided.name, voided.samples) == ("llmgw_evidence_voided", [])
