"""`llmgw plan`: the planning bound and the cost of low/base/high demand (llmgw/ops/plan.py)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path
from typing import Any

from llmgw.cli.common import snapshot_or_report
from llmgw.ops import choice
from llmgw.ops.plan import (
    CAPACITY_BLOCK_USD,
    PRICES_AS_OF,
    SCENARIOS,
    Hosted,
    Reserves,
    Workload,
    cost_per_million_tokens,
    measured,
    plan_scenario,
)

DEFAULT_RHO_MAX = 0.7


def _hosted(args: argparse.Namespace) -> Hosted | str | None:
    """The hosted route to compare with: of its candidates with endpoints (providers), the eligible one
    with the lowest cost per accepted task (llmgw/ops/choice.py), priced by its deployment; or prices
    given directly. A string is the reason there is none."""
    if args.hosted_input_per_mtok is not None or args.hosted_output_per_mtok is not None:
        return Hosted("given prices", args.hosted_input_per_mtok or 0.0, args.hosted_output_per_mtok or 0.0)
    if not args.hosted_route:
        return None
    snap = snapshot_or_report(args.config)
    if snap is None:
        return "invalid configuration"
    route = snap.routes.get(args.hosted_route)
    if route is None:
        return f"no route {args.hosted_route} in {args.config}"
    priced = [p for p in choice.price(snap, route, date.today(), args.input_tokens, args.output_tokens)
              if snap.deployments[p.deployment].endpoints]
    if not priced:
        return f"route {args.hosted_route} has no hosted candidate"
    chosen = choice.cheapest(priced, route.request_class)
    if chosen is None:
        return f"route {args.hosted_route} has no eligible hosted candidate ({'; '.join(p.why_not for p in priced)})"
    dep = snap.deployments[chosen.deployment]
    p = dep.prices  # integer micro-units of its currency per million tokens
    # Accepted tasks are the ones answered right: its prices over its quality score.
    score = chosen.quality or 1.0
    graded = f", quality {chosen.quality:.2f}" if chosen.quality is not None else ""
    return Hosted(f"{args.hosted_route} ({dep.deployment}, prices {p.version}, {p.currency}{graded})",
                  p.input_per_mtok / 1e6 / score, p.output_per_mtok / 1e6 / score)


def _money(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}" if v >= 100 else f"{v:.4g}"


def cmd_plan(args: argparse.Namespace) -> int:
    price = args.price_per_accelerator_hour
    if price is None:
        price = CAPACITY_BLOCK_USD[args.instance]
        source = f"{args.instance} Capacity Block rate effective {PRICES_AS_OF} (the built-in price table)"
    else:
        source = "given"
    try:
        at_util = cost_per_million_tokens(price, args.tokens_per_second, args.utilization)
        at_full = cost_per_million_tokens(price, args.tokens_per_second, 1.0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# Capacity plan\n\nprice: {price:.3f} USD per accelerator-hour ({source}); "
          f"{args.tokens_per_second:g} tokens/s per accelerator at full load\n")
    print(f"cost per million tokens: {at_full:.3f} USD at full utilisation, {at_util:.3f} USD at "
          f"{args.utilization:.0%} utilisation")
    if args.peak_rps is None:
        return 0
    tokens = args.input_tokens + args.output_tokens
    try:
        sweep = measured(json.loads(Path(args.sweep).read_text()), args.sweep_accelerators) if args.sweep else None
    except (OSError, ValueError) as e:
        print(f"error: --sweep: {e}", file=sys.stderr)
        return 2
    if args.service_seconds is not None:
        service, how = args.service_seconds, "measured (given)"
    elif sweep is not None:
        service, how = sweep.service_s, (f"measured by the sweep: {sweep.accelerators} accelerator(s) / mu "
                                         f"{sweep.mu_rps:.3g} req/s")
    else:
        service = tokens / args.tokens_per_second
        how = f"estimated: {tokens:g} tokens per request / {args.tokens_per_second:g} tokens/s"
    # rho_max: given, else where the sweep's SLO gate still held (below 1: the bound needs slack), else 0.7.
    rho_max = args.rho_max if args.rho_max is not None else (
        min(sweep.slo_utilization, 0.99) if sweep is not None and sweep.slo_utilization else DEFAULT_RHO_MAX)
    work = Workload(args.peak_rps, service, args.input_tokens, args.output_tokens, args.peak_hours_per_day)
    reserves = Reserves(rho_max, args.headroom, args.redundancy, args.allocation_unit)
    hosted = _hosted(args)
    if isinstance(hosted, str):
        print(f"error: {hosted}", file=sys.stderr)
        return 2
    print(f"\nE[S] = {service:.4g} accelerator-seconds per request ({how}); rho_max {reserves.rho_max}, headroom "
          f"{reserves.headroom:.0%}, redundancy {reserves.redundancy} unit(s) of {reserves.allocation_unit}; "
          f"{work.peak_hours_per_day:g} h/day at peak\n")
    rows = [plan_scenario(name, demand, work, reserves, price, hosted) for name, demand in SCENARIOS.items()]
    head = ["scenario", "peak req/s", "g_min", "provisioned", "mu_g req/s", "stable", "accepted/day", "refused/day",
            "utilisation", "idle acc-h/day", "USD/day", "USD/accepted task", "USD/M tokens",
            "hosted USD/day", "hosted USD/task"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r.name} | {r.peak_rps:g} | {r.g_min} | {r.provisioned} | {r.service_rps:.3g} | "
              f"{'yes' if r.stable else 'NO'} | {r.accepted_per_day:,.0f} | {r.refused_per_day:,.0f} | "
              f"{r.utilization:.0%} | {r.idle_accelerator_hours_per_day:,.1f} | {_money(r.cost_per_day)} | "
              f"{_money(r.cost_per_accepted_task)} | {_money(r.cost_per_million_tokens)} | "
              f"{_money(r.hosted_cost_per_day)} | {_money(r.hosted_cost_per_accepted_task)} |")
    if hosted is not None:
        print(f"\nhosted: {hosted.name}: {hosted.input_per_mtok:g} / {hosted.output_per_mtok:g} per million input / "
              "output tokens")
    if sweep is not None and sweep.slo_utilization:
        print(f"\nSLO attainment: measured by the sweep on route {sweep.route}: the gate held up to "
              f"{sweep.slo_utilization:.0%} utilisation (the knee over mu); rho_max "
              f"{'is that' if args.rho_max is None else 'given: ' + str(args.rho_max)}, so the plan sizes to "
              "where it holds for the swept trace's mix.")
    elif sweep is not None:
        print("\nSLO attainment: the sweep's gate held at no level - no utilisation meets the SLO on that pool; "
              "the sizes above meet load, not the SLO.")
    else:
        print("\nSLO attainment: not measured here - the bound is necessary, not sufficient for p95/p99; run "
              "`llmgw bench sweep` and size from where its attainment holds (--sweep sweep.json).")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="accelerators and cost for low/base/high demand (the planning bound)")
    p.add_argument("--instance", choices=sorted(CAPACITY_BLOCK_USD), default="P5",
                   help=f"price from the built-in Capacity Block table (effective {PRICES_AS_OF})")
    p.add_argument("--price-per-accelerator-hour", type=float, help="USD; overrides --instance")
    p.add_argument("--tokens-per-second", type=float, default=1500.0, help="per accelerator at full load")
    p.add_argument("--utilization", type=float, default=1.0, help="for the cost-per-million-tokens figure")
    p.add_argument("--peak-rps", type=float, help="lambda_peak of the base scenario (requests/s); without it, "
                   "only the cost per token is printed")
    p.add_argument("--service-seconds", type=float, help="E[S], measured accelerator-seconds per request")
    p.add_argument("--input-tokens", type=float, default=1000.0, help="per request, mean")
    p.add_argument("--output-tokens", type=float, default=250.0, help="per request, mean")
    p.add_argument("--peak-hours-per-day", type=float, default=24.0)
    p.add_argument("--rho-max", type=float, help=f"planning cap on utilisation (default: the sweep's utilisation at "
                   f"the SLO, else {DEFAULT_RHO_MAX})")
    p.add_argument("--sweep", help="a sweep.json (llmgw bench sweep): E[S] and rho_max from what it measured")
    p.add_argument("--sweep-accelerators", type=int, default=1, help="accelerators in the swept pool")
    p.add_argument("--headroom", type=float, default=0.2)
    p.add_argument("--redundancy", type=int, default=1, help="allocation units kept for failures")
    p.add_argument("--allocation-unit", type=int, default=8, help="accelerators per placement")
    p.add_argument("--hosted-route", help="compare with this route's hosted candidate, priced by its deployment")
    p.add_argument("--config", default="policy")
    p.add_argument("--hosted-input-per-mtok", type=float)
    p.add_argument("--hosted-output-per-mtok", type=float)
    p.set_defaults(func=cmd_plan)
