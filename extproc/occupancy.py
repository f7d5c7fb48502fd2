"""What the store holds right now, as Prometheus gauges read at scrape time: open reservations and
in-flight tokens, each budget's reserved amount and what remains of it in its current window, and each
admission-controlled pool's slots held and requests waiting.

These are the store's facts, shared by every worker and every host, so they are read from the store
when `/metrics` is scraped (one pipelined round trip, bounded by the store's timeout) instead of
being counted by each worker. Without a store, or when it does not answer, `llmgw_store_up` is 0 and
the other gauges are absent: a missing series, not a stale one. Beside them, from the serving
revision itself: `llmgw_evidence_voided` (extproc/config/evidence.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from extproc.config import Snapshot
from extproc.stages.budget import window_id
from extproc.store import Occupancy, Store, StoreUnavailable, budget_key


def voided_evidence(snap: Snapshot) -> GaugeMetricFamily:
    """Evidence records a re-evaluation trigger voided, per deployment of the serving revision (its
    candidate left routing where nothing else qualifies it; `llmgw check` says why)."""
    g = GaugeMetricFamily("llmgw_evidence_voided", "Evidence records voided by a re-evaluation trigger, per "
                          "deployment (price, quota or data-class policy change; provider drift, workload "
                          "shift, SLO regression)", labels=["deployment"])
    by_ref = {d.ref: d.deployment for d in snap.deployments.values()}
    for ref, why in sorted(snap.voided.items()):
        g.add_metric([by_ref.get(ref, ref)], len(why))
    return g


def families(snap: Snapshot, held: Occupancy | None, tenant_label: bool) -> list[Metric]:
    up = GaugeMetricFamily("llmgw_store_up", "Whether the store answered this scrape", value=held is not None)
    if held is None:
        return [up, voided_evidence(snap)]
    leases = GaugeMetricFamily("llmgw_reservations_open", "Reservations held now: admitted requests not yet settled",
                               value=sum(held.leases.values()))
    tokens = GaugeMetricFamily("llmgw_inflight_tokens", "Tokens reserved by the requests in flight (their bounds)",
                               value=sum(held.inflight_tokens.values()))
    out: list[Metric] = [up, leases, tokens]
    if held.slots:
        slots = GaugeMetricFamily("llmgw_admission_slots", "Requests admitted to a pool with admission and not yet "
                                  "settled, across every worker and replica", labels=["pool"])
        waiting = GaugeMetricFamily("llmgw_admission_waiting", "Requests waiting in a pool's admission queue, across "
                                    "every worker and replica", labels=["pool"])
        for p in sorted(held.slots):
            slots.add_metric([p], held.slots[p])
            waiting.add_metric([p], held.waiting.get(p, 0))
        out += [slots, waiting]
    if tenant_label:
        per = GaugeMetricFamily("llmgw_tenant_reservations_open", "Reservations held now, per tenant "
                                "(metrics.tenant_label)", labels=["tenant"])
        for t, n in sorted(held.leases.items()):
            per.add_metric([t], n)
        out.append(per)
    reserved = GaugeMetricFamily("llmgw_budget_reserved", "Held by requests in flight, per budget, in its current "
                                 "window (unit: micros of the price currency, or tokens)", labels=["budget", "unit"])
    remaining = GaugeMetricFamily("llmgw_budget_remaining", "The limit less what is settled and reserved, per budget, "
                                  "in its current window", labels=["budget", "unit"])
    now = datetime.now(UTC)
    for b in snap.gateway.budgets:
        use = held.budgets.get(budget_key(b.tenant, b.name, window_id(b.window, now)[0]))
        if use is None:
            continue
        for unit, limit, r, s in (("micros", b.limit_micros, use.reserved_micros, use.settled_micros),
                                  ("tokens", b.limit_tokens, use.reserved_tokens, use.settled_tokens)):
            reserved.add_metric([b.name, unit], r)
            if limit is not None:
                remaining.add_metric([b.name, unit], limit - s - r)
    return [*out, reserved, remaining, voided_evidence(snap)]


async def read(store: Store | None, snap: Snapshot) -> Occupancy | None:
    if store is None:
        return None
    now = datetime.now(UTC)
    keys = [budget_key(b.tenant, b.name, window_id(b.window, now)[0]) for b in snap.gateway.budgets]
    try:
        pools = sorted(p for p, pool in snap.gateway.pools.items() if pool.admission is not None)
        return await store.occupancy(sorted(snap.gateway.tenants), keys, pools)
    except StoreUnavailable:
        return None


class _Fixed:
    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


async def exposition(store: Store | None, snap: Snapshot) -> bytes:
    """The gauges as Prometheus text (appended to the workers' metrics)."""
    registry = CollectorRegistry()
    registry.register(_Fixed(families(snap, await read(store, snap), snap.gateway.metrics.tenant_label)))
    return generate_latest(registry)
