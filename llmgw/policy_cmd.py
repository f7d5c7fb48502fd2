"""`llmgw policy`: the policy author's commands.

- `test DIR [-v] [--coverage] [-z]`: the Rego tests, with `opa test`'s output and exit codes (0 all
  passed, 2 a test failed, erred or was skipped, 1 the policy did not load).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from extproc.config import ConfigError, load_snapshot
from extproc.config.policy_tests import TestReport, TestResult, run_isolated

RULE = "-" * 80


def _duration(ns: int) -> str:
    return f"{ns / 1e6:.1f}ms" if ns >= 1_000_000 else f"{ns / 1e3:.1f}µs"


def _line(r: TestResult) -> str:
    return f"{r.name}: {r.outcome}" + (f" ({_duration(r.duration_ns)})" if r.outcome != "SKIPPED" else "")


def _details(r: TestResult, verbose: bool) -> list[str]:
    out = [f"  {r.error}"] if r.error else []
    if verbose and r.outcome == "FAIL":
        out.append(f"  value: {'undefined' if r.value is None else json.dumps(r.value)}")
    out += [f"  {p}" for p in r.prints] if verbose or r.outcome != "PASS" else []
    return out


def render_report(report: TestReport, verbose: bool) -> str:
    """The report as `opa test` prints it: failures first (with their details), then per file the
    results (all of them with -v, else the ones that did not pass), then the counts."""
    lines: list[str] = []
    bad = [r for r in report.results if r.outcome in ("FAIL", "ERROR")]
    if bad:
        lines += ["FAILURES", RULE]
        for r in bad:
            lines += [_line(r), "", *_details(r, verbose), ""]
        lines += ["SUMMARY", RULE]
    shown = report.results if verbose else [r for r in report.results if not r.passed]
    for file in dict.fromkeys(r.file for r in shown):
        lines.append(f"{file}:")
        for r in (x for x in shown if x.file == file):
            lines.append(_line(r))
            if verbose and r.passed:
                lines += _details(r, verbose)
        lines.append("")
    total = len(report.results)
    lines.append(RULE)
    for outcome in ("PASS", "FAIL", "SKIPPED", "ERROR"):
        n = sum(r.outcome == outcome for r in report.results)
        if n or (outcome == "PASS" and total):
            lines.append(f"{outcome}: {n}/{total}")
    return "\n".join(lines)


def exit_code(report: TestReport, exit_zero_on_skipped: bool = False) -> int:
    """`opa test`'s codes: 1 when the policy did not load, 2 when a test did not pass."""
    if report.load_errors:
        return 1
    failing = [r for r in report.results if not r.passed and not (r.outcome == "SKIPPED" and exit_zero_on_skipped)]
    return 2 if failing else 0


def load_modules(directory: str) -> tuple[dict[str, str], dict[str, Any]] | None:
    """The directory's Rego (policy and tests) and `data.gateway`, or None after printing why not."""
    try:
        snap = load_snapshot(directory)
    except ConfigError as e:
        print(f"error: invalid configuration\n{e}", file=sys.stderr)
        return None
    return dict(snap.rego), dict(snap.policy_data)


def cmd_policy_test(args: argparse.Namespace) -> int:
    loaded = load_modules(args.dir)
    if loaded is None:
        return 1
    report = run_isolated(*loaded, coverage=args.coverage)
    for error in report.load_errors:
        print(f"error: {error}", file=sys.stderr)
    if report.load_errors:
        return 1
    print(json.dumps(report.coverage, indent=2) if args.coverage else render_report(report, args.verbose))
    return exit_code(report, args.exit_zero_on_skipped)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("policy", help="Rego policy: test, evaluate, dry-run differences")
    psub = p.add_subparsers(dest="policy_command", required=True)
    t = psub.add_parser("test", help="run the Rego tests (test_* rules), as `opa test` does")
    t.add_argument("dir", nargs="?", default="policy")
    t.add_argument("-v", "--verbose", action="store_true", help="every result, print() output, failing values")
    t.add_argument("--coverage", action="store_true", help="print which lines the tests reached (JSON, as OPA)")
    t.add_argument("-z", "--exit-zero-on-skipped", action="store_true", help="skipped (todo_) tests exit 0")
    t.set_defaults(func=cmd_policy_test)
    from llmgw.rego_conformance import add_parser as add_conformance

    add_conformance(psub)

