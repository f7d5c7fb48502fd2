"""Capacity planning (`llmgw plan`): the planning bound, the stability check, reserves, the
allocation unit, and low/base/high demand priced per accelerator-hour beside a hosted route's
per-token prices.

    g_min = ceil(lambda_peak * E[S] / rho_max)        accelerators, a lower bound
    lambda < mu_g                                      stability: offered load below measured service rate
    cost per million tokens = price per accelerator-hour / (tokens/s per accelerator * 3600 * utilisation) * 1e6

E[S] is accelerator-seconds of service per request under the production mix, measured (a sweep, or
the ledger and the engines' metrics); rho_max < 1 is the planning cap on utilisation. The bound does
not promise p95 or p99 latency: only a sweep through saturation shows where the SLO breaks, so a plan
without one says its attainment is not measured.

Default prices: AWS Capacity Block rates per accelerator-hour effective 2026-10-07, as AWS
listed them (dynamic prices: pass your own with --price-per-accelerator-hour).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PRICES_AS_OF = "2026-10-07"
CAPACITY_BLOCK_USD = {  # per accelerator-hour
    "P6-B300": 16.146, "P6-B200": 14.208, "P5en": 7.895, "P5e": 6.866, "P5": 5.970, "P4de": 2.546, "P4d": 1.696,
}
HOURS_PER_MONTH = 730.0


def cost_per_million_tokens(price_per_accelerator_hour: float, tokens_per_second: float, utilization: float) -> float:
    """What a million tokens cost when each accelerator serves `tokens_per_second` at full load and
    is busy `utilization` of the time it is billed."""
    if tokens_per_second <= 0 or not 0 < utilization <= 1:
        raise ValueError("tokens per second must be positive and utilization in (0, 1]")
    return price_per_accelerator_hour / (tokens_per_second * 3600 * utilization) * 1e6


def accelerators_min(peak_rps: float, service_s: float, rho_max: float) -> int:
    """g_min = ceil(lambda_peak * E[S] / rho_max)."""
    if not 0 < rho_max < 1:
        raise ValueError("rho_max must be in (0, 1)")
    return max(1, math.ceil(peak_rps * service_s / rho_max - 1e-9))


@dataclass(frozen=True)
class Measured:
    """What a sweep (`llmgw bench sweep`'s sweep.json) says about the pool it ran on."""

    accelerators: int  # in the swept pool
    mu_rps: float  # the most requests completed per second at any level
    slo_utilization: float | None  # the knee's completed rate over mu: where the gate still held
    route: str

    @property
    def service_s(self) -> float:
        """E[S] = accelerators / mu: accelerator-seconds per request at saturation, under the trace's mix."""
        return self.accelerators / self.mu_rps


def measured(sweep: dict[str, Any], accelerators: int) -> Measured:
    """The sweep's figures for the planner; ValueError when it measured nothing usable."""
    mu = float(sweep.get("mu_rps") or 0.0)
    if mu <= 0 or accelerators < 1:
        raise ValueError("the sweep completed no requests, or --sweep-accelerators is below 1")
    util = sweep.get("slo_utilization") or {}
    route, value = next(iter(util.items()), ("", None))
    return Measured(accelerators, mu, float(value) if value is not None else None, route)


@dataclass(frozen=True)
class Workload:
    peak_rps: float  # lambda_peak of the base scenario, requests per second
    service_s: float  # E[S]: accelerator-seconds per request
    input_tokens: float  # per request, mean
    output_tokens: float  # per request, mean
    peak_hours_per_day: float = 24.0  # hours a day at the scenario's peak rate (the rest idle but billed)


@dataclass(frozen=True)
class Reserves:
    rho_max: float = 0.7
    headroom: float = 0.2  # for deploys, maintenance and forecast error, a fraction of the bound
    redundancy: int = 1  # allocation units kept for failures (N+k)
    allocation_unit: int = 8  # accelerators per placement (the supplier's unit)


@dataclass(frozen=True)
class Hosted:
    name: str
    input_per_mtok: float  # price per million input tokens
    output_per_mtok: float


@dataclass(frozen=True)
class ScenarioPlan:
    name: str
    demand: float  # multiple of the base peak rate
    peak_rps: float
    g_min: int
    provisioned: int  # accelerators: the bound with headroom, rounded up to units, plus redundancy
    service_rps: float  # mu_g of what is provisioned (without the redundant units: they cover failures)
    stable: bool  # lambda < mu_g
    accepted_per_day: float
    refused_per_day: float  # offered beyond mu_g at peak: refused or timed out, never queued forever
    utilization: float  # busy accelerator-time / billed accelerator-time over a day
    idle_accelerator_hours_per_day: float  # billed, not serving
    cost_per_day: float
    cost_per_accepted_task: float
    cost_per_million_tokens: float  # of accepted tasks' tokens (input and output)
    hosted_cost_per_day: float | None  # the same accepted tasks on the hosted route
    hosted_cost_per_accepted_task: float | None


def plan_scenario(name: str, demand: float, work: Workload, reserves: Reserves, price_per_accelerator_hour: float,
                  hosted: Hosted | None = None) -> ScenarioPlan:
    peak = work.peak_rps * demand
    g_min = accelerators_min(peak, work.service_s, reserves.rho_max)
    serving = math.ceil(g_min * (1 + reserves.headroom) / reserves.allocation_unit - 1e-9) * reserves.allocation_unit
    provisioned = serving + reserves.redundancy * reserves.allocation_unit
    mu = serving / work.service_s
    served_rps = min(peak, mu)
    seconds_at_peak = work.peak_hours_per_day * 3600
    accepted = served_rps * seconds_at_peak
    refused = max(0.0, peak - mu) * seconds_at_peak
    busy_hours = accepted * work.service_s / 3600
    billed_hours = provisioned * 24.0
    cost = billed_hours * price_per_accelerator_hour
    tokens = accepted * (work.input_tokens + work.output_tokens)
    hosted_cost = (accepted * (work.input_tokens * hosted.input_per_mtok + work.output_tokens * hosted.output_per_mtok)
                   / 1e6) if hosted else None
    return ScenarioPlan(
        name=name, demand=demand, peak_rps=peak, g_min=g_min, provisioned=provisioned, service_rps=mu,
        stable=peak < mu, accepted_per_day=accepted, refused_per_day=refused,
        utilization=busy_hours / billed_hours, idle_accelerator_hours_per_day=billed_hours - busy_hours,
        cost_per_day=cost, cost_per_accepted_task=cost / accepted if accepted else math.inf,
        cost_per_million_tokens=cost / tokens * 1e6 if tokens else math.inf,
        hosted_cost_per_day=hosted_cost,
        hosted_cost_per_accepted_task=hosted_cost / accepted if hosted_cost is not None and accepted else None)


SCENARIOS = {"low": 0.5, "base": 1.0, "high": 1.5}
