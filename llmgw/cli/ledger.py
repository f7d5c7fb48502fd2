"""`llmgw ledger tail|export|get|resolve|reconcile`: read the ledger streams (one per tenant,
`llmgw:{tenant}:ledger`), or with `--decisions` the decision log streams (`llmgw:{tenant}:decisions`,
extproc/decisions.py); one request's entry; an Idempotency-Key left ambiguous, resolved.

`export` reads with a consumer group and acknowledges what it wrote, so repeated exports continue
where the last one stopped; into a file, each record is exported exactly once (cmd_export); `tail` only
reads. `--format focus` writes
FOCUS cost rows (llmgw/ops/focus.py) as CSV instead of the records as JSON lines: each batch of records
aggregated, written, then acknowledged (a later export may add rows for the same period).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import redis

from extproc.store import IDEM_AMBIGUOUS, decisions_key, ledger_entry, ledger_key
from llmgw.cli.common import snapshot_or_report
from llmgw.ops.focus import COLUMNS, FOCUS_VERSION, aggregate, record
from llmgw.ops.ledger import decision_entry, entries_of, forget_ambiguous, key_state, ledger_entries
from llmgw.ops.reconcile import invoice_days, ledger_days, reconcile
from llmgw.ops.store import store_client, store_url

GROUP = "llmgw-export"


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


def cmd_get(args: argparse.Namespace) -> int:
    """One request's ledger entry (by its id), or every entry sent with an Idempotency-Key and what the
    store holds of the key now - as JSON. Exit 1 when nothing is found."""
    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    found = entries_of(client, tenants, args.request_id or "", args.idempotency_key or "")
    if args.idempotency_key:
        states = {t: state for t in tenants if (state := key_state(client, t, args.idempotency_key))}
        print(json.dumps({"idempotency_key": states, "entries": found}, indent=2))
        return 0 if found or states else 1
    for entry in found:
        print(json.dumps(entry, indent=2))
    if not found:
        print(f"no ledger entry for request {args.request_id}", file=sys.stderr)
    return 0 if found else 1


def cmd_resolve(args: argparse.Namespace) -> int:
    """An Idempotency-Key left ambiguous (its request may have run, and nothing says what it did) is
    forgotten once the operator has found out (the upstream's own records, the tools' effects): a retry
    with it then runs. A key in any other state is not touched."""
    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    resolved = 0
    for tenant in tenants:
        held = key_state(client, tenant, args.idempotency_key)
        found = forget_ambiguous(client, tenant, args.idempotency_key)
        if found == IDEM_AMBIGUOUS:
            resolved += 1
            print(f"{tenant}: the key of request {held.get('request_id', '?')} was ambiguous; forgotten: a retry "
                  "with it runs")
        elif found:
            print(f"{tenant}: the key is {found} (request {held.get('request_id', '?')}): not ambiguous, left as it is")
    if not resolved:
        print("no ambiguous Idempotency-Key by that name", file=sys.stderr)
    return 0 if resolved else 1


def _sid(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def exported(path: str, focus: bool) -> dict[str, tuple[int, int]]:
    """The last entry id of each stream already in the output file (the export's commit point): JSON
    lines carry `export_stream` and `export_id` (the record's own `stream` says whether the request
    streamed), FOCUS rows `x_export_batch` (stream and its batch's last id)."""
    last: dict[str, tuple[int, int]] = {}
    if path == "-" or not Path(path).exists():
        return last
    with open(path, newline="") as f:
        marks = ((r.get("x_export_batch") or "").rpartition(" ")[::2] for r in csv.DictReader(f)) if focus else (
            (d.get("export_stream", ""), d.get("export_id", "")) for line in f if line.strip()
            for d in [json.loads(line)])
        for stream, eid in marks:
            if stream and eid:
                last[stream] = max(last.get(stream, (0, 0)), _sid(eid))
    return last


def cmd_export(args: argparse.Namespace) -> int:
    """Exactly once into a file: a batch is written and fsynced (the commit point), then acknowledged.
    Entries delivered to this consumer but never acknowledged (an export that died between the two, or
    an acknowledgement a store failover lost) are read again first: those the output already holds are
    only acknowledged, the rest written. To stdout it is at least once."""
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
    done = exported(args.output, focus)
    out = open(args.output, "a", newline="") if args.output != "-" else sys.stdout  # noqa: SIM115 - closed below
    writer = csv.DictWriter(out, fieldnames=COLUMNS) if focus else None
    if writer is not None and fresh:
        writer.writeheader()

    def write(key: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        if writer is not None and snap is not None:
            rows = aggregate((decode(f) for _, f in entries), snap, args.period)
            batch = f"{key} {entries[-1][0]}"
            writer.writerows({**record(r, args.period), "x_export_batch": batch} for r in rows)
        else:
            for eid, fields in entries:
                out.write(json.dumps({**decode(fields), "export_stream": key, "export_id": eid}) + "\n")
        out.flush()
        if out is not sys.stdout:
            os.fsync(out.fileno())

    total = 0
    try:
        for t in tenants:
            key = key_of(t)
            try:
                client.xgroup_create(key, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            after = "0"  # first this consumer's pending entries (from "0"), then new ones (">")
            while True:
                got: Any = client.xreadgroup(GROUP, args.consumer, {key: after}, count=1000)
                entries = got[0][1] if got else []
                if not entries:
                    if after == ">":
                        break
                    after = ">"
                    continue
                if after != ">":
                    after = entries[-1][0]
                # (A pending entry trimmed from the stream since comes back without fields: nothing to write.)
                fresh_entries = [(eid, f) for eid, f in entries
                                 if f is not None and _sid(eid) > done.get(key, (-1, -1))]
                if fresh_entries:
                    write(key, fresh_entries)
                client.xack(key, GROUP, *(eid for eid, _ in entries))  # only what the output holds
                total += len(fresh_entries)
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


def _store_options(p: argparse.ArgumentParser) -> None:
    """Where the ledger is: the policy's store (or --store-url), every tenant's or one's."""
    p.add_argument("--config", default="policy")
    p.add_argument("--state-dir", default=".llmgw")
    p.add_argument("--store-url")
    p.add_argument("--tenant")


def register(sub: Any) -> None:
    led = sub.add_parser("ledger", help="the ledger: one record per authenticated request")
    lsub = led.add_subparsers(dest="ledger_command", required=True)
    for name, func, helptext in (("tail", cmd_tail, "print recent records (and follow with -f)"),
                                 ("export", cmd_export, "export unexported records, acknowledging them")):
        p = lsub.add_parser(name, help=helptext)
        _store_options(p)
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
    g = lsub.add_parser("get", help="one request's entry, or every entry of an Idempotency-Key and its state")
    which = g.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-id")
    which.add_argument("--idempotency-key")
    v = lsub.add_parser("resolve", help="forget an Idempotency-Key left ambiguous, so a retry with it runs")
    v.add_argument("--idempotency-key", required=True)
    for p, func in ((g, cmd_get), (v, cmd_resolve)):
        _store_options(p)
        p.set_defaults(func=func)
    r = lsub.add_parser("reconcile", help="one deployment's per-day totals against its provider's invoice")
    _store_options(r)
    r.add_argument("--invoice", required=True,
                   help="the provider's invoice: CSV (date, model, tokens, amount) or FOCUS")
    r.add_argument("--deployment", required=True)
    r.add_argument("--tolerance", type=float, default=0.0,
                   help="an amount difference allowed beyond the ledger's rounding, as a fraction of the invoice's")
    r.set_defaults(func=cmd_reconcile)
