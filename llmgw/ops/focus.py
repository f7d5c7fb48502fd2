"""Ledger entries as FOCUS cost rows (`llmgw ledger export --format focus`): the gateway is where tokens
are counted, so it is the issuer of the chargeback its tenants see, in the FinOps Open Cost and Usage
Specification's columns.

FOCUS version: 1.0, the latest the `focus-validator` package on PyPI validates (its 1.0 rule set names
a few columns as it does - `InvoiceIssuer`, `Provider`, `Publisher`, `ResourceID` - and the export
follows the validator). Gateway columns carry the `x_` prefix.

One row per (charge period, tenant, route, route revision, deployment, price version, token class):
token classes are `input` (prompt tokens the cache neither read nor wrote), `cached_input` (cache
reads), `cache_write` and `cache_write_1h` (cache writes at the 5-minute or only rate, and at the 1-hour
rate), `output` and `reasoning` (the output's reasoning tokens), each at the deployment's price for it;
`ConsumedQuantity` and `PricingQuantity` are tokens. Amounts are exact
decimals: each entry's class costs are its tokens at the list price, and the rounding the ledger
applied (it charges whole micro-units) goes to the entry's last class, so a row's `BilledCost` sums
to exactly what the ledger charged. An entry charged without usage (an ambiguous answer, charged its
whole reservation) is one `unmetered` row with no quantity; an entry priced under another price
version than the deployment has now is one `tokens` row at what it was charged. An attempt before the
answer that was sent, never answered and charged at its bound (it may have run) is an
`unanswered_attempt` row of the deployment it went to, its quantity the bound's tokens and no unit
price. Entries charged nothing (refused, released) make no row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from extproc.config import Snapshot
from extproc.config.schema import Deployment
from extproc.settlement.charge import token_classes

FOCUS_VERSION = "1.0"
MICRO = Decimal("0.000001")
MTOK = Decimal(1_000_000)
COLUMNS = (
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodStart",
    "BillingPeriodEnd", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargeFrequency",
    "ChargePeriodStart", "ChargePeriodEnd", "CommitmentDiscountCategory", "CommitmentDiscountId",
    "CommitmentDiscountName", "CommitmentDiscountStatus", "CommitmentDiscountType", "ConsumedQuantity",
    "ConsumedUnit", "ContractedCost", "ContractedUnitPrice", "EffectiveCost", "InvoiceIssuer", "ListCost",
    "ListUnitPrice", "PricingCategory", "PricingQuantity", "PricingUnit", "Provider", "Publisher", "RegionId",
    "RegionName", "ResourceID", "ResourceName", "ResourceType", "ServiceCategory", "ServiceName", "SkuId",
    "SkuPriceId", "SkuMeter", "SubAccountId", "SubAccountName", "Tags",
    "x_tenant", "x_route", "x_route_revision", "x_price_version", "x_ledger_entries", "x_focus_version",
    "x_export_batch",  # the ledger stream and the last entry id of the export batch the row came from
)


@dataclass
class Row:
    """One aggregated charge: what the key says, summed over the entries that share it."""

    key: tuple[str, ...]  # period start, tenant, route, revision, deployment, price version, class
    currency: str
    unit_price: Decimal | None  # per token; None: not priced per token (unmetered, another version)
    tokens: int = 0
    list_cost: Decimal = Decimal(0)
    billed: Decimal = Decimal(0)
    entries: int = 0
    deployment: Deployment | None = field(default=None, repr=False)


def period_start(ts: float, period: str) -> datetime:
    t = datetime.fromtimestamp(ts, UTC)
    return t.replace(minute=0, second=0, microsecond=0) if period == "hour" else t.replace(
        hour=0, minute=0, second=0, microsecond=0)


def _classes(entry: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The entry's tokens by class, as the ledger charged them (extproc/settlement/charge.py `token_classes`)."""
    return list(token_classes(entry.get("usage") or {}).items())


def _price(dep: Deployment, token_class: str) -> Decimal:
    """Currency units per token."""
    return Decimal(dep.prices.per_mtok(token_class)) * MICRO / MTOK


def aggregate(entries: Iterable[Mapping[str, Any]], snap: Snapshot, period: str = "day") -> list[Row]:
    rows: dict[tuple[str, ...], Row] = {}

    def add(key: tuple[str, ...], currency: str, price: Decimal | None, dep: Deployment | None, tokens: int,
            list_cost: Decimal, billed: Decimal, first: bool) -> None:
        row = rows.setdefault(key, Row(key, currency, price, deployment=dep))
        row.tokens += tokens
        row.list_cost += list_cost
        row.billed += billed
        row.entries += 1 if first else 0

    for e in entries:
        charged = Decimal(int(e.get("charged_micros") or 0)) * MICRO
        if charged <= 0:
            continue
        attempts = e.get("attempts") or [{}]
        name = attempts[-1].get("deployment", "")
        dep = snap.deployments.get(name)
        currency = dep.prices.currency if dep else "USD"
        start = period_start(float(e.get("time") or 0), period).isoformat()
        base = (start, str(e.get("tenant", "")), str(e.get("route", "")), str(e.get("route_revision", "")), name,
                str(e.get("price_version", "")))
        # Attempts before the answer that were sent, never answered, and charged at their bound (invariant
        # 23): a row of their own per deployment, no unit price (a bound, not metered tokens).
        for a in attempts[:-1]:
            if a.get("settlement") == "unknown" and (micros := int(a.get("charged_micros") or 0)) > 0:
                cost = Decimal(micros) * MICRO
                tried = str(a.get("deployment") or name)
                add((start, *base[1:4], tried, base[5], "unanswered_attempt"), currency, None,
                    snap.deployments.get(tried), int(a.get("charged_tokens") or 0), cost, cost, False)
                charged -= cost
        if charged <= 0:
            continue
        classes = [(c, n) for c, n in _classes(e) if n > 0]
        if not classes or dep is None:
            add((*base, "unmetered"), currency, None, dep, 0, charged, charged, True)
            continue
        if dep.prices.version != e.get("price_version"):
            add((*base, "tokens"), currency, None, dep, sum(n for _, n in classes), charged, charged, True)
            continue
        costs = [(c, n, n * _price(dep, c)) for c, n in classes]
        remainder = charged - sum(cost for _, _, cost in costs)  # the ledger's rounding up to a micro-unit
        for i, (c, n, cost) in enumerate(costs):
            billed = cost + (remainder if i == len(costs) - 1 else 0)
            add((*base, c), currency, _price(dep, c), dep, n, cost, billed, i == 0)
    return sorted(rows.values(), key=lambda r: r.key)


def _decimal(d: Decimal | int) -> str:
    """A FOCUS decimal: always with a decimal point (a column of bare integers reads as integers)."""
    text = format(Decimal(d).normalize(), "f")
    return text if "." in text else text + ".0"


def record(row: Row, period: str) -> dict[str, str]:
    start_s, tenant, route, revision, name, version, token_class = row.key
    start = datetime.fromisoformat(start_s)
    end = start + (timedelta(hours=1) if period == "hour" else timedelta(days=1))
    month = start.replace(day=1, hour=0)
    next_month = (month + timedelta(days=32)).replace(day=1)
    dep = row.deployment
    provider = dep.provider if dep is not None else "unknown"
    region = dep.regions[0] if dep is not None else ""
    price = _decimal(row.unit_price) if row.unit_price is not None else ""
    unit = "Tokens" if token_class != "unmetered" else ""
    return {
        "BilledCost": _decimal(row.billed), "BillingAccountId": tenant, "BillingAccountName": tenant,
        "BillingCurrency": row.currency, "BillingPeriodStart": month.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "BillingPeriodEnd": next_month.strftime("%Y-%m-%dT%H:%M:%SZ"), "ChargeCategory": "Usage",
        "ChargeClass": "", "ChargeDescription": f"{token_class} tokens of {name} through route {route}",
        "ChargeFrequency": "Usage-Based", "ChargePeriodStart": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "ChargePeriodEnd": end.strftime("%Y-%m-%dT%H:%M:%SZ"), "CommitmentDiscountCategory": "",
        "CommitmentDiscountId": "", "CommitmentDiscountName": "", "CommitmentDiscountStatus": "",
        "CommitmentDiscountType": "", "ConsumedQuantity": _decimal(row.tokens) if unit else "", "ConsumedUnit": unit,
        "ContractedCost": _decimal(row.billed), "ContractedUnitPrice": price,
        "EffectiveCost": _decimal(row.billed), "InvoiceIssuer": "llmgw", "ListCost": _decimal(row.list_cost),
        "ListUnitPrice": price,
        "PricingCategory": "Standard", "PricingQuantity": _decimal(row.tokens) if unit else "", "PricingUnit": unit,
        "Provider": provider, "Publisher": provider, "RegionId": region, "RegionName": region,
        "ResourceID": name, "ResourceName": name, "ResourceType": "LLM deployment",
        "ServiceCategory": "AI and Machine Learning", "ServiceName": "LLM inference",
        "SkuId": f"{name}:{token_class}", "SkuPriceId": f"{name}:{token_class}:{version}", "SkuMeter": token_class,
        "SubAccountId": route, "SubAccountName": route, "Tags": json.dumps({"route": route}),
        "x_tenant": tenant, "x_route": route, "x_route_revision": revision, "x_price_version": version,
        "x_ledger_entries": str(row.entries), "x_focus_version": FOCUS_VERSION,
    }
