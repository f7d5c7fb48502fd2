"""`llmgw evaluate --route R [--candidate D]`: the route's request class's task-quality corpus against
each candidate through a sandboxed gateway (llmgw/quality/), graded by code, and its quality_gate
record written into the policy directory (unless --dry-run). Exit 0 when every candidate reached the
class's threshold, 1 when one did not, 2 on bad arguments."""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from extproc.corpora import quality_corpus
from llmgw.cli.common import snapshot_or_report
from llmgw.conformance.record import write_record
from llmgw.conformance.runner import not_recorded, sandbox_faults, session
from llmgw.quality.corpus import load_quality
from llmgw.quality.evaluate import evaluate_in


def cmd_evaluate(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 2
    route = snap.routes.get(args.route)
    if route is None:
        print(f"error: no route {args.route!r}", file=sys.stderr)
        return 2
    names = [c.deployment_name for c in route.candidates]
    if args.candidate and args.candidate not in names:
        print(f"error: {args.candidate!r} is not a candidate of {args.route} ({', '.join(names)})", file=sys.stderr)
        return 2
    rc = snap.gateway.request_classes[route.request_class]
    if rc.quality is None:
        print(f"error: request class {route.request_class} declares no quality gate (gateway.yaml "
              f"request_classes.{route.request_class}.quality)", file=sys.stderr)
        return 2
    corpus = load_quality(quality_corpus(rc.quality.corpus, snap.directory))
    today = datetime.now(UTC).date()
    failed = False
    for name in [args.candidate] if args.candidate else names:
        with tempfile.TemporaryDirectory(prefix="llmgw-evaluate-") as work, \
                session(Path(args.config), name, Path(work), [route], [t.request for t in corpus.tasks],
                        args.time_scale, simulate_providers=args.simulate_providers, engine=args.engine,
                        sim_quality=args.sim_quality) as s:
            result = evaluate_in(s, corpus, route, rc.quality.threshold)
        print(f"{name}  {result.deployment_ref}  class {result.request_class}  corpus {corpus.version} "
              f"({corpus.digest})")
        for r in result.results:
            print(f"  {r.result.upper():8} {r.id}" + (f"  - {r.detail}" if r.detail else ""))
        verdict = "PASS" if result.passed else "FAIL"
        print(f"  score {result.score:.4f} against threshold {result.threshold}: {verdict}")
        failed |= not result.passed
        if faults := sandbox_faults(result.results):
            print(not_recorded(faults))
        elif not args.dry_run:
            path = write_record(Path(args.config), snap, name, route, result.evidence(today, args.valid_days),
                                corpus.digest)
            print(f"  wrote {path}")
    return 1 if failed else 0


def register(sub: Any) -> None:
    e = sub.add_parser("evaluate", help="grade a route's candidates on its request class's task-quality corpus and "
                                        "write their quality_gate evidence")
    e.add_argument("--config", default="policy", help="policy directory")
    e.add_argument("--route", required=True, help="the route: its request class names the corpus and threshold")
    e.add_argument("--candidate", help="only this candidate (default: every one)")
    e.add_argument("--valid-days", type=int, default=90, help="the record expires this many days after today")
    e.add_argument("--time-scale", type=float, default=0.02, help="the simulated engines' real seconds per second")
    e.add_argument("--dry-run", action="store_true", help="print the results, write no record")
    e.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="the pool's engines in the sandbox: simulated, or real vLLM (`make test-vllm` installs it)")
    e.add_argument("--simulate-providers", action="store_true",
                   help="serve hosted deployments on loopback with simulated providers, as `llmgw up` does")
    e.add_argument("--sim-quality", type=float, default=None, metavar="SHARE",
                   help="the simulators' answer quality, an operator's setting: right on this share of the tasks "
                        "(default: none right - the simulator's text is seeded words)")
    e.set_defaults(func=cmd_evaluate)
