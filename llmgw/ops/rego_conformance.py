"""`llmgw policy conformance CASES_DIR`: OPA's own conformance cases against the Rego engines
installable here, to choose the gateway's engine by measurement (docs/POLICY_ENGINE.md).

The cases are OPA's YAML files (`v1/test/cases/testdata/v1/<category>/*.yaml` in OPA's repository;
they stay out of this project): each case has `modules`, optional `data` and `input` (or
`input_term`), a `query` binding `x`, and either `want_result` (the list of bindings) or
`want_error` / `want_error_code`. A case passes when the engine gives exactly the wanted bindings, or
fails with an error where one is wanted. Each case file runs in a process of its own per engine, so
an engine that crashes the process (a native fault) is counted as crashing, not as the harness dying.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ENGINES = ("regorus", "regopy")


def _canonical(value: Any) -> Any:
    """Bindings compared as OPA compares them: sets (lists here) in sorted order, numbers by value."""
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _regorus(case: dict[str, Any]) -> list[dict[str, Any]]:
    import regorus

    engine = regorus.Engine()
    for i, text in enumerate(case.get("modules") or []):
        engine.add_policy(f"mod{i}.rego", text)
    engine.add_data_json(json.dumps(case.get("data") or {}))
    if "input" in case or "input_term" in case:
        engine.set_input_json(case["input_term"] if "input_term" in case else json.dumps(case["input"]))
    out = json.loads(engine.eval_query_as_json(case["query"]))
    return [r.get("bindings", {}) for r in out.get("result", [])]


def _regopy(case: dict[str, Any]) -> list[dict[str, Any]]:
    import regopy

    rego = regopy.Interpreter()
    for i, text in enumerate(case.get("modules") or []):
        rego.add_module(f"mod{i}.rego", text)
    rego.add_data_json(json.dumps(case.get("data") or {}))
    if "input" in case or "input_term" in case:
        rego.set_input(regopy.Input(json.loads(case["input_term"]) if "input_term" in case else case["input"]))
    out = rego.query(case["query"])
    if not out.ok():
        raise RuntimeError("query failed")
    text = str(out)
    if text == "undefined":
        return []
    return [json.loads(line).get("bindings", {}) for line in text.splitlines() if line.strip()]


RUNNERS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {"regorus": _regorus, "regopy": _regopy}


def run_case(engine: str, case: dict[str, Any]) -> dict[str, Any]:
    """One case: pass, fail (wrong answer) or error (an error where a result was wanted, or a panic)."""
    wants_error = "want_error" in case or "want_error_code" in case
    started = time.perf_counter()
    try:
        got = RUNNERS[engine](case)
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        outcome = "pass" if wants_error else ("panic" if type(e).__name__ == "PanicException" else "error")
        detail = str(e).split("\nStack backtrace:")[0][-300:]
        return {"note": case.get("note", ""), "outcome": outcome, "detail": detail,
                "us": (time.perf_counter() - started) * 1e6}
    elapsed = (time.perf_counter() - started) * 1e6
    if wants_error:
        return {"note": case.get("note", ""), "outcome": "fail", "detail": f"no error; got {got!r}"[:300],
                "us": elapsed}
    want = case.get("want_result") or []
    ok = _canonical(got) == _canonical(want)
    return {"note": case.get("note", ""), "outcome": "pass" if ok else "fail",
            "detail": "" if ok else f"want {want!r}, got {got!r}"[:300], "us": elapsed}


def run_file_isolated(engine: str, path: Path, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every case of one file, in a process of its own; a crash or hang fails them all as `crash`."""
    cases = (yaml.safe_load(path.read_text()) or {}).get("cases") or []
    try:
        done = subprocess.run([sys.executable, "-m", "llmgw.ops.rego_conformance", "--worker", engine, str(path)],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            return [dict(json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]
        why = f"exit {done.returncode}"
    except subprocess.TimeoutExpired:
        why = "timeout"
    return [{"note": c.get("note", ""), "outcome": "crash", "detail": why, "us": 0.0} for c in cases]


def measure(cases_dir: Path, engines: list[str]) -> dict[str, dict[str, Counter[str]]]:
    """Per engine, per category (the case file's folder), the count of each outcome."""
    table: dict[str, dict[str, Counter[str]]] = {e: defaultdict(Counter) for e in engines}
    for path in sorted(cases_dir.rglob("*.yaml")):
        for engine in engines:
            for result in run_file_isolated(engine, path):
                table[engine][path.parent.name][result["outcome"]] += 1
                if result["outcome"] != "pass":
                    print(f"{engine} {path.parent.name}/{path.name}: {result['outcome']}: {result['note']}: "
                          f"{result['detail']}", file=sys.stderr)
    return table


def render(table: dict[str, dict[str, Counter[str]]], files: int) -> str:
    engines = list(table)
    categories = sorted({c for e in engines for c in table[e]})
    outcomes = ("pass", "fail", "error", "panic", "crash")
    head = "| category | cases | " + " | ".join(f"{e} pass" for e in engines) + " |"
    lines = [head, "|" + "---|" * (2 + len(engines))]
    for cat in categories:
        n = sum(table[engines[0]][cat].values())
        lines.append(f"| {cat} | {n} | " + " | ".join(str(table[e][cat]["pass"]) for e in engines) + " |")
    lines.append("")
    for e in engines:
        total = Counter[str]()
        for c in table[e].values():
            total.update(c)
        n = sum(total.values())
        parts = ", ".join(f"{k} {total[k]}" for k in outcomes if total[k])
        lines.append(f"- {e}: {total['pass']}/{n} passed ({100 * total['pass'] / max(n, 1):.1f}%); {parts} "
                     f"({files} case files)")
    return "\n".join(lines)


def installed(engine: str) -> bool:
    try:
        __import__(engine)
    except ImportError:
        return False
    return True


def cmd_conformance(args: argparse.Namespace) -> int:
    cases_dir = Path(args.cases)
    files = sorted(cases_dir.rglob("*.yaml"))
    if not files:
        print(f"error: no OPA case files (*.yaml) under {cases_dir}", file=sys.stderr)
        return 1
    engines = [e for e in (args.engine or ENGINES) if installed(e)]
    missing = sorted(set(args.engine or ENGINES) - set(engines))
    if missing:
        print(f"not installed, skipped: {', '.join(missing)} (pip install '.[rego-compare]')", file=sys.stderr)
    print(render(measure(cases_dir, engines), len(files)))
    return 0


def _worker(engine: str, path: str) -> None:
    for case in (yaml.safe_load(Path(path).read_text()) or {}).get("cases") or []:
        print(json.dumps(run_case(engine, case)), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
