"""`llmgw conformance --route R | --deployment D`: run the conformance corpus against each candidate
(llmgw/conformance/) and write its evidence record, `evidence/<deployment>-conformance-<route>.yaml`,
into the policy directory (unless --dry-run). The record is earned under the route's retry and fallback
policy (with --deployment: the first route that has it as a candidate). Exit 0 when every candidate
passed, 1 when one failed, 2 on bad arguments."""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llmgw.cli.common import snapshot_or_report
from llmgw.conformance.corpus import corpus_for, load_corpus
from llmgw.conformance.record import write_record
from llmgw.conformance.runner import not_recorded, run, sandbox_faults


def cmd_conformance(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 2
    if not (args.route or args.deployment):
        print("error: name --route, --deployment or both", file=sys.stderr)
        return 2
    if args.route:
        route = snap.routes.get(args.route)
        if route is None:
            print(f"error: no route {args.route!r}", file=sys.stderr)
            return 2
        names = [c.deployment_name for c in route.candidates if args.deployment in (None, c.deployment_name)]
        if not names:
            print(f"error: {args.deployment!r} is not a candidate of {args.route}", file=sys.stderr)
            return 2
    else:
        names = [args.deployment]
    unknown = [n for n in names if n not in snap.deployments]
    if unknown:
        print(f"error: no deployment {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.case and not args.dry_run:
        print("error: --case runs part of the corpus, which qualifies nothing: add --dry-run", file=sys.stderr)
        return 2
    given = load_corpus(Path(args.corpus)) if args.corpus else None
    only = set(args.case) if args.case else None
    today = datetime.now(UTC).date()
    failed = False
    for name in names:
        with tempfile.TemporaryDirectory(prefix="llmgw-conformance-") as work:
            corpus = given or corpus_for(snap.deployments[name].serves)
            try:
                result = run(Path(args.config), name, corpus, Path(work), args.time_scale, only,
                             simulate_providers=args.simulate_providers, engine=args.engine, route=args.route)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        print(f"{name}  {result.deployment_ref}  adapter {result.adapter}  corpus {result.corpus_version} "
              f"({result.corpus_digest})  under route {result.route}")
        for r in result.results:
            print(f"  {r.result.upper():8} {r.id}" + (f"  - {r.detail}" if r.detail else ""))
        counts = {k: sum(r.result == k for r in result.results) for k in ("pass", "fail", "lost", "not_run")}
        lost = f"; reported lost: {', '.join(sorted(result.losses))}" if result.losses else ""
        print("  " + ", ".join(f"{v} {k}" for k, v in counts.items()) + lost)
        failed |= not result.passed
        if faults := sandbox_faults(result.results):
            print(not_recorded(faults))
        elif not args.dry_run:
            path = write_record(Path(args.config), snap, name, snap.routes[result.route],
                                result.evidence(today, args.valid_days), result.corpus_digest)
            print(f"  wrote {path}")
    return 1 if failed else 0


def register(sub: Any) -> None:
    c = sub.add_parser("conformance", help="run the conformance corpus against candidates and write their evidence")
    c.add_argument("--config", default="policy", help="policy directory")
    c.add_argument("--route", help="every candidate of this route, under its retry and fallback policy")
    c.add_argument("--deployment", help="this deployment (with --route: this candidate of it; alone: under the "
                                        "first route that has it)")
    c.add_argument("--corpus", help="the corpus file (default: the gateway's own for what the deployment serves: "
                                    "chat completions, or embeddings)")
    c.add_argument("--case", action="append",
                   help="run only this case (repeatable; needs --dry-run: part of the corpus writes no record)")
    c.add_argument("--valid-days", type=int, default=90, help="the record expires this many days after today")
    c.add_argument("--time-scale", type=float, default=0.02, help="the simulated engines' real seconds per second")
    c.add_argument("--dry-run", action="store_true", help="print the results, write no record")
    c.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="the pool's engines in the sandbox: simulated, or real vLLM (its CPU build serving a "
                        "generated tiny model; `make test-vllm` installs it)")
    c.add_argument("--simulate-providers", action="store_true",
                   help="serve hosted deployments on loopback with simulated providers, as `llmgw up` does")
    c.set_defaults(func=cmd_conformance)
