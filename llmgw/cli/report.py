"""`llmgw report -o FILE.html`: the ledger and the host's metrics as one page (llmgw/ops/report.py)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from llmgw.cli.common import snapshot_or_report
from llmgw.cli.ledger import ledger_entries, open_store


def _metrics(args: argparse.Namespace) -> tuple[str | None, str]:
    """(the Prometheus text or None, where it came from or why there is none)."""
    url = args.metrics_url
    up = Path(args.state_dir) / "up.json"
    if not url and up.exists():
        url = json.loads(up.read_text()).get("metrics_url")
    if not url:
        return None, "no metrics URL (pass --metrics-url or run `llmgw up`)"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode(), url
    except OSError as e:
        return None, f"{url} did not answer ({e})"


def cmd_report(args: argparse.Namespace) -> int:
    opened = open_store(args)
    snap = snapshot_or_report(args.config)
    if opened is None or snap is None:
        return 1
    client, tenants = opened
    entries = ledger_entries(client, tenants)
    text, source = _metrics(args)
    from llmgw.ops.report import render  # matplotlib loads only for this command

    page, report = render(entries, snap, text, source)
    Path(args.output).write_text(page)
    print(f"wrote {args.output}: {len(report.requests)} ledger entries, "
          f"{sum(s.points for s in report.sections)} plotted points", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    r = sub.add_parser("report", help="one HTML page from the ledger and the metrics (plots embedded)")
    r.add_argument("--config", default="policy")
    r.add_argument("--state-dir", default=".llmgw")
    r.add_argument("--store-url")
    r.add_argument("--tenant", help="one tenant's requests (default: every tenant)")
    r.add_argument("--metrics-url", help="the host's Prometheus text (default: metrics_url in STATE_DIR/up.json)")
    r.add_argument("-o", "--output", default="report.html")
    r.set_defaults(func=cmd_report)
