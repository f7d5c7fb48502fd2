"""`llmgw ledger reconcile`: the ledger's per-day totals of one deployment against the provider's
invoice for it - who counted the tokens, and do the counts agree.

The invoice is a CSV of `date, model, input_tokens, cached_input_tokens, output_tokens, currency,
amount` rows (the shape the simulated providers write: `GET /admin/invoice`), or a FOCUS file (rows of
`ChargePeriodStart`, `ResourceID`, `SkuMeter` and `ConsumedQuantity`, `BilledCost`: a provider's FOCUS
export, or this gateway's own). Per UTC day: input (cached included), cached input and output tokens
must agree exactly; the amount within the ledger's own rounding (it charges each request up to a
whole micro-unit) plus `--tolerance` (a fraction of the invoice's amount). A day the ledger has and no
invoice row covers is reported as an estimate: the gateway's figure, not yet confirmed by a bill.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

MICRO = Decimal("0.000001")


@dataclass
class DayTotals:
    input: int = 0
    cached_input: int = 0
    output: int = 0
    amount: Decimal = Decimal(0)
    entries: int = 0  # ledger entries (each rounded up to a micro-unit at most once)


@dataclass
class Difference:
    day: str
    what: str  # input | cached_input | output | amount | estimate | not_in_ledger
    ledger: str
    invoice: str

    def __str__(self) -> str:
        if self.what == "estimate":
            return f"{self.day}  estimate: no invoice covers the ledger's {self.ledger}"
        return f"{self.day}  {self.what}: ledger {self.ledger}, invoice {self.invoice}"


@dataclass
class Reconciliation:
    deployment: str
    differences: list[Difference] = field(default_factory=list)
    days: int = 0

    @property
    def agrees(self) -> bool:
        return not [d for d in self.differences if d.what != "estimate"]


def ledger_days(entries: Iterable[Mapping[str, Any]], deployment: str) -> dict[str, DayTotals]:
    """The deployment's totals per UTC day: the tokens each answering attempt reported, and what the
    ledger charged for them."""
    days: dict[str, DayTotals] = {}
    for e in entries:
        if ((e.get("attempts") or [{}])[-1]).get("deployment") != deployment:
            continue
        usage = e.get("usage") or {}
        charged = int(e.get("charged_micros") or 0)
        if not usage and not charged:
            continue
        t = days.setdefault(datetime.fromtimestamp(float(e.get("time") or 0), UTC).strftime("%Y-%m-%d"), DayTotals())
        t.input += int(usage.get("prompt_tokens") or 0)
        t.cached_input += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        t.output += int(usage.get("completion_tokens") or 0)
        t.amount += Decimal(charged) * MICRO
        t.entries += 1
    return days


def invoice_days(path: Path, deployment: str, model: str) -> dict[str, DayTotals]:
    """The invoice's totals per day for this deployment (its rows name the model it serves, or - in
    a FOCUS file - the deployment as the resource)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    days: dict[str, DayTotals] = {}
    for r in rows:
        if "ChargePeriodStart" in r:  # FOCUS
            if r.get("ResourceID") != deployment:
                continue
            t = days.setdefault(r["ChargePeriodStart"][:10], DayTotals())
            qty = int(Decimal(r.get("ConsumedQuantity") or 0))
            meter = r.get("SkuMeter", "")
            t.input += qty if meter in ("input", "cached_input", "cache_write", "cache_write_1h") else 0
            t.cached_input += qty if meter == "cached_input" else 0
            t.output += qty if meter in ("output", "reasoning") else 0
            t.amount += Decimal(r.get("BilledCost") or 0)
        else:
            if r.get("model") != model:
                continue
            t = days.setdefault(r["date"], DayTotals())
            t.input += int(r["input_tokens"])
            t.cached_input += int(r.get("cached_input_tokens") or 0)
            t.output += int(r["output_tokens"])
            t.amount += Decimal(r["amount"])
    return days


def reconcile(ledger: Mapping[str, DayTotals], invoice: Mapping[str, DayTotals], deployment: str,
              tolerance: Decimal = Decimal(0)) -> Reconciliation:
    out = Reconciliation(deployment, days=len(set(ledger) | set(invoice)))
    for day in sorted(set(ledger) | set(invoice)):
        mine, theirs = ledger.get(day), invoice.get(day)
        if theirs is None:
            assert mine is not None
            out.differences.append(Difference(day, "estimate", f"{mine.amount} for {mine.entries} entries", ""))
            continue
        if mine is None:
            out.differences.append(Difference(day, "not_in_ledger", "nothing", f"{theirs.amount}"))
            continue
        for what in ("input", "cached_input", "output"):
            if getattr(mine, what) != getattr(theirs, what):
                out.differences.append(Difference(day, what, str(getattr(mine, what)), str(getattr(theirs, what))))
        rounding = (mine.entries + 1) * MICRO  # each entry rounded up once, the invoice's total once
        if abs(mine.amount - theirs.amount) > rounding + tolerance * theirs.amount:
            out.differences.append(Difference(day, "amount", str(mine.amount), str(theirs.amount)))
    return out
