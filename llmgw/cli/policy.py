"""`llmgw policy`: the policy author's commands.

- `test DIR [-v] [--coverage] [-z]`: the Rego tests, with `opa test`'s output and exit codes (0 all
  passed, 2 a test failed, erred or was skipped, 1 the policy did not load).
- `eval --input FILE | --request FILE`: the decision for an input document, or for an HTTP request
  sample taken through the same stages ext_proc runs (identity, intake, authorization), printed with
  its reasons, obligations and the answer the gateway would give at that point.
- `diff`: what a dry run of a candidate policy found (gateway.yaml `policy_dry_run`).
- `conformance CASES`: OPA's conformance cases against the engines installed here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from extproc.config import Snapshot
from extproc.config.policy import PolicyEvaluationError
from extproc.config.policy_tests import TestReport, TestResult, run_isolated
from extproc.contract import GatewayError
from extproc.decisions import new_decision_id, result_of
from extproc.exchange import Exchange
from extproc.jwks import JwksCache
from extproc.stages.authorize import Authorization, policy_input
from extproc.stages.identity import CallerIdentity
from extproc.stages.intake import Intake
from llmgw.cli.common import snapshot_or_report
from llmgw.ops import rego_conformance

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
    """The directory's Rego (policy and tests) and `data.gateway`, or None after printing why not. A
    folder of Rego alone (no gateway.yaml, like policy/examples) is loaded as it is, with no data."""
    root = Path(directory)
    if not (root / "gateway.yaml").is_file():
        modules = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.rego"))}
        if not modules:
            print(f"error: no gateway.yaml and no .rego files in {directory}", file=sys.stderr)
            return None
        return modules, {}
    snap = snapshot_or_report(directory)
    return None if snap is None else (dict(snap.rego), dict(snap.policy_data))


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


def input_schema() -> dict[str, Any]:
    """The input document's JSON Schema (extproc/config/policy_input.schema.json)."""
    doc: dict[str, Any] = json.loads(resources.files("extproc.config").joinpath("policy_input.schema.json").read_text())
    return doc


def read_request(path: Path) -> tuple[str, str, dict[str, str], bytes]:
    """An HTTP request sample: JSON (`method`, `path`, `headers`, `body` as an object or a string) or
    the request as HTTP/1.1 text (request line, headers, blank line, body). Header names lowercased."""
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "headers" in doc:
        body = doc.get("body", b"")
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else str(body).encode()
        return (str(doc.get("method", "POST")), str(doc.get("path", "/v1/chat/completions")),
                {str(k).lower(): str(v) for k, v in doc["headers"].items()}, data)
    head, _, body_bytes = raw.replace(b"\r\n", b"\n").partition(b"\n\n")
    request_line, *header_lines = head.decode("utf-8", "replace").splitlines()
    method, target, *_ = request_line.split()
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if ":" in h)}
    return method, target, headers, body_bytes


async def decide_request(snap: Snapshot, method: str, path: str, headers: dict[str, str],
                         body: bytes) -> dict[str, Any]:
    """What ext_proc decides for this request, through its own stages up to authorization."""
    ex = Exchange(snapshot=snap, method=method, path=path, headers=headers, raw_body=body,
                  request_id=headers.get("x-request-id", "policy-eval"))
    answer: dict[str, Any] = {"status": 200, "admitted": "by policy; budgets, redaction and routing come next"}
    try:
        for stage in (CallerIdentity(JwksCache()), Intake(), Authorization()):
            await stage.run(ex)
    except GatewayError as e:
        answer = {"status": e.status, "body": json.loads(e.body(ex.decision_id))}
    out: dict[str, Any] = {"revision": snap.revision, "answer": answer}
    if ex.decision_id:
        out["decision_id"] = ex.decision_id
    if ex.identity is not None and ex.route is not None and ex.data_class:
        out["input"] = policy_input(ex, ex.data_class)
        out["result"] = result_of(ex.decision, "the policy could not be evaluated")
    return out


def cmd_policy_eval(args: argparse.Namespace) -> int:
    """Print the decision for an input document or a request sample; exit 0 allowed, 2 refused, 1 error."""
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    assert snap.policy is not None
    if args.input:
        doc = json.loads(Path(args.input).read_text())
        problems = sorted(jsonschema.Draft202012Validator(input_schema()).iter_errors(doc), key=str)
        for p in problems:
            where = "/" + "/".join(map(str, p.absolute_path))
            print(f"warning: input {where}: {p.message} (not what ext_proc sends)", file=sys.stderr)
        try:
            result = result_of(snap.policy.evaluate(doc))
        except PolicyEvaluationError as e:
            result = result_of(None, str(e))
        out: dict[str, Any] = {"decision_id": new_decision_id(), "revision": snap.revision, "input": doc,
                               "result": result}
        print(json.dumps(out, indent=2))
        return 1 if "error" in result else 0 if result["allow"] else 2
    out = asyncio.run(decide_request(snap, *read_request(Path(args.request))))
    print(json.dumps(out, indent=2))
    return 0 if out["answer"]["status"] == 200 else 2


def summarise_dry_run(counts: dict[str, int], entries: list[dict[str, Any]], revision: str) -> str:
    """A dry run in words: how many decisions it saw, how many differed and how, with examples."""
    evaluated, differing = counts.get("evaluated", 0), counts.get("differing", 0)
    lines = [f"dry run {revision}: {evaluated} decision(s) evaluated beside the enforced policy, "
             f"{differing} differed ({100 * differing / max(evaluated, 1):.1f}%)"]
    for kind in ("allow", "reasons", "obligations", "error"):
        if counts.get(kind):
            lines.append(f"  {kind}: {counts[kind]}")
    flips: dict[str, int] = {}
    for e in entries:
        enforced, candidate = e["result"], e["dry_run"]["result"]
        if "allow" in e["dry_run"]["differences"]:
            flip = f"{'allow' if enforced['allow'] else 'deny'} -> {'allow' if candidate['allow'] else 'deny'}"
            flips[flip] = flips.get(flip, 0) + 1
    for flip, n in sorted(flips.items()):
        lines.append(f"    {flip}: {n}")
    if entries:
        lines.append("latest differences (enforced decision id -> candidate decision id):")
    for e in entries[-5:]:
        cand = e["dry_run"]
        why = ", ".join(cand["result"].get("reasons", [])) or cand["result"].get("error", "")
        lines.append(f"  {e['request_id']}: {e['decision_id']} -> {cand['decision_id']} "
                     f"[{', '.join(cand['differences'])}] {why}"[:240])
    return "\n".join(lines)


def cmd_policy_diff(args: argparse.Namespace) -> int:
    from extproc.store import decisions_key, dry_run_key
    from llmgw.cli.ledger import decision_entry, open_store

    opened = open_store(args)
    if opened is None:
        return 1
    client, tenants = opened
    revisions = [args.revision] if args.revision else sorted(
        k.removeprefix(dry_run_key("")) for k in client.scan_iter(match=dry_run_key("*")))
    if not revisions:
        print("no dry run has been recorded (gateway.yaml policy_dry_run)", file=sys.stderr)
        return 1
    entries = sorted((decision_entry(f) for t in tenants for _, f in client.xrange(decisions_key(t))),
                     key=lambda e: str(e.get("timestamp", "")))
    for rev in revisions:
        counts = {k: int(v) for k, v in client.hgetall(dry_run_key(rev)).items()}
        mine = [e for e in entries if e.get("dry_run", {}).get("revision") == rev]
        print(summarise_dry_run(counts, mine, rev))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("policy", help="Rego policy: test, evaluate, dry-run differences")
    psub = p.add_subparsers(dest="policy_command", required=True)
    t = psub.add_parser("test", help="run the Rego tests (test_* rules), as `opa test` does")
    t.add_argument("dir", nargs="?", default="policy")
    t.add_argument("-v", "--verbose", action="store_true", help="every result, print() output, failing values")
    t.add_argument("--coverage", action="store_true", help="print which lines the tests reached (JSON, as OPA)")
    t.add_argument("-z", "--exit-zero-on-skipped", action="store_true", help="skipped (todo_) tests exit 0")
    t.set_defaults(func=cmd_policy_test)
    e = psub.add_parser("eval", help="the decision for an input document or an HTTP request sample")
    e.add_argument("--config", default="policy")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", metavar="FILE", help="an input document (JSON; schema: policy/README.md)")
    src.add_argument("--request", metavar="FILE", help="a request: JSON {method, path, headers, body} or HTTP text")
    e.set_defaults(func=cmd_policy_eval)
    d = psub.add_parser("diff", help="what a dry run of a candidate policy found (gateway.yaml policy_dry_run)")
    for flag, default in (("--config", "policy"), ("--state-dir", ".llmgw"), ("--store-url", None), ("--tenant", None)):
        d.add_argument(flag, default=default)
    d.add_argument("--revision", help="one candidate revision (default: every one recorded)")
    d.set_defaults(func=cmd_policy_diff)
    c = psub.add_parser("conformance", help="run OPA's conformance cases against the Rego engines installed here")
    c.add_argument("cases", help="a folder of OPA's case files (v1/test/cases/testdata/v1 or part of it)")
    c.add_argument("--engine", action="append", choices=rego_conformance.ENGINES, help="only this engine (repeatable)")
    c.set_defaults(func=rego_conformance.cmd_conformance)
