"""`llmgw ledger tail|export`: read the ledger streams (one per tenant, `llmgw:{tenant}:ledger`), or
with `--decisions` the decision log streams (`llmgw:{tenant}:decisions`, extproc/decisions.py).

`export` reads with a consumer group and acknowledges what it wrote, so repeated exports continue
where the last one stopped and a record is exported once; `tail` only reads. `--format focus` writes
FOCUS cost rows (llmgw/focus.py) as CSV instead of the records as JSON lines: each batch of records
aggregated, written, then acknowledged (a later export may add rows for the same period).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import redis

from extproc.store import decisions_key, ledger_entry, ledger_key
from llmgw.cli_common import snapshot_or_report, store_client
from llmgw.focus import COLUMNS, FOCUS_VERSION, aggregate, record
from llmgw.reconcile import invoice_days, ledger_days, reconcile

GROUP = "llmgw-export"


def store_url(args: argparse.Namespace, config_url: str | None) -> str | None:
    if args.store_url:
        return str(args.store_url)
    if config_url:
        return config_url
    up = Path(args.state_dir) / "up.json"
    if up.exists():
        url: str | None = json.loads(up.read_text()).get("store_url")
        return url
    return None


def ledger_entries(client: Any, tenants: Sequence[str]) -> list[dict[str, Any]]:
    """Every ledger entry of these tenants, oldest first per tenant (read only: nothing acknowledged)."""
    return [ledger_entry(f) for t in tenants for _, f in client.xrange(ledger_key(t))]


def decision_entry(fields: dict[str, str]) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(fields.get("entry") or "{}")
    return entry


def _stream(args: argparse.Namespace) -> tuple[Any, Any]:
    """(key of a tenant's stream, decoder of its entries): the ledger, or the decision log."""
    return (decisions_key, decision_entry) if getattr(args, "decisions", False) else (ledger_key, ledger_entry)


def open_store(args: argparse.Namespace) -> tuple[Any, list[str]] | None:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return None
    url = store_url(args, snap.gateway.store.url)
    if not url:
        print("error: no store: pass --store-url, set store.url, or run `llmgw up`", file=sys.stderr)
        return None
    tenants = [args.tenant] if args.tenant else sorted(snap.gateway.tenants)
    return store_client(url), tenants


def cmd_tail(args: argparse.Namespace) -> int:
    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    key_of, decode = _stream(args)
    last: dict[str, str] = {}
    for key in (key_of(t) for t in tenants):
        entries: Any = client.xrange(key) if args.all else list(reversed(client.xrevrange(key, count=args.n)))
        for _, fields in entries:
            print(json.dumps(decode(fields)))
        last[key] = entries[-1][0] if entries else "0-0"
    while args.follow and last:
        # One stream per read: on a Redis Cluster the tenants' streams live on different nodes.
        for key in last:
            got: Any = client.xread({key: last[key]}, count=500, block=max(50, 1000 // len(last)))
            for _, new in got or []:
                for eid, fields in new:
                    print(json.dumps(decode(fields)), flush=True)
                    last[key] = eid
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    key_of, decode = _stream(args)
    focus = args.format == "focus"
    if focus and args.decisions:
        print("error: --format focus exports the ledger, not the decision log", file=sys.stderr)
        return 2
    snap = snapshot_or_report(args.config) if focus else None
    fresh = args.output == "-" or not Path(args.output).exists() or Path(args.output).stat().st_size == 0
    out = open(args.output, "a", newline="") if args.output != "-" else sys.stdout  # noqa: SIM115 - closed below
    writer = csv.DictWriter(out, fieldnames=COLUMNS) if focus else None
    if writer is not None and fresh:
        writer.writeheader()
    total = 0
    try:
        for t in tenants:
            key = key_of(t)
            try:
                client.xgroup_create(key, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            while True:
                got: Any = client.xreadgroup(GROUP, args.consumer, {key: ">"}, count=1000)
                entries = got[0][1] if got else []
                if not entries:
                    break
                if writer is not None and snap is not None:
                    rows = aggregate((decode(f) for _, f in entries), snap, args.period)
                    writer.writerows(record(r, args.period) for r in rows)
                else:
                    for _, fields in entries:
                        out.write(json.dumps(decode(fields)) + "\n")
                out.flush()
                client.xack(key, GROUP, *(eid for eid, _ in entries))  # only what was written
                total += len(entries)
    finally:
        if out is not sys.stdout:
            out.close()
    shape = f" as FOCUS {FOCUS_VERSION} rows" if focus else ""
    print(f"exported {total} record(s){shape} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
          file=sys.stderr)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    snap = snapshot_or_report(args.config)
    if snap is None or args.deployment not in snap.deployments:
        print(f"error: no deployment {args.deployment} in {args.config}", file=sys.stderr)
        return 2
    dep = snap.deployments[args.deployment]
    entries = ledger_entries(client, tenants)
    result = reconcile(ledger_days(entries, dep.deployment), invoice_days(Path(args.invoice), dep.deployment,
                                                                         dep.served_model),
                       dep.deployment, Decimal(str(args.tolerance)))
    for d in result.differences:
        print(d)
    print(f"{dep.deployment}: {result.days} day(s); " + ("the ledger and the invoice agree" if result.agrees else
          f"{sum(d.what != 'estimate' for d in result.differences)} difference(s)"))
    return 0 if result.agrees else 1


def add_parser(sub: Any) -> None:
    led = sub.add_parser("ledger", help="the ledger: one record per authenticated request")
    lsub = led.add_subparsers(dest="ledger_command", required=True)
    for name, func, helptext in (("tail", cmd_tail, "print recent records (and follow with -f)"),
                                 ("export", cmd_export, "export unexported records, acknowledging them")):
        p = lsub.add_parser(name, help=helptext)
        p.add_argument("--config", default="policy")
        p.add_argument("--state-dir", default=".llmgw")
        p.add_argument("--store-url")
        p.add_argument("--tenant")
        p.add_argument("--decisions", action="store_true", help="the decision log instead of the ledger")
        p.set_defaults(func=func)
        if name == "tail":
            p.add_argument("-n", type=int, default=20)
            p.add_argument("-f", "--follow", action="store_true")
            p.add_argument("--all", action="store_true", help="every record from the start")
        else:
            p.add_argument("--format", choices=["jsonl", "focus"], default="jsonl",
                           help=f"focus: FOCUS {FOCUS_VERSION} cost rows as CSV (one per period, tenant, route, "
                                "deployment, price version and token class)")
            p.add_argument("--period", choices=["day", "hour"], default="day", help="(focus) the charge period")
            p.add_argument("-o", "--output", default="-")
            p.add_argument("--consumer", default="cli")
    r = lsub.add_parser("reconcile", help="one deployment's per-day totals against its provider's invoice")
    r.add_argument("--config", default="policy")
    r.add_argument("--state-dir", default=".llmgw")
    r.add_argument("--store-url")
    r.add_argument("--tenant")
    r.add_argument("--invoice", required=True,
                   help="the provider's invoice: CSV (date, model, tokens, amount) or FOCUS")
    r.add_argument("--deployment", required=True)
    r.add_argument("--tolerance", type=float, default=0.0,
                   help="an amount difference allowed beyond the ledger's rounding, as a fraction of the invoice's")
    r.set_defaults(func=cmd_reconcile)
