"""The policy's Rego tests, run as `opa test` runs them: every rule named `test_*` in any module is a
test, passing when it is defined and not false; `todo_test_*` rules are skipped; tests state their
input with `with input as ...` and replace data with `with data.x as ...`; `print()` output is kept.

They run in a process of their own (`run_isolated`): a native crash in the engine then fails the run
with a message instead of taking down ext_proc (a reload that runs the tests) or `llmgw policy test`.
`python -m extproc.config.policy_tests` reads {"modules", "data", "coverage"} on stdin and writes the
report as JSON.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from extproc.config.rego_engine import PolicyCompileError, compile_modules, engine_message, is_panic, plain

RUNNER = (sys.executable, "-m", "extproc.config.policy_tests")
_PACKAGE = re.compile(r"^package\s+([\w.]+)", re.M)
_TEST_RULE = re.compile(r"^((?:todo_)?test_\w+)\b", re.M)


@dataclass(frozen=True)
class TestResult:
    file: str
    package: str
    rule: str
    outcome: str  # PASS, FAIL, ERROR or SKIPPED, as `opa test` names them
    duration_ns: int = 0
    value: Any = None  # what a failing test evaluated to (None: undefined)
    error: str = ""
    prints: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"data.{self.package}.{self.rule}"

    @property
    def passed(self) -> bool:
        return self.outcome == "PASS"


@dataclass
class TestReport:
    results: list[TestResult] = field(default_factory=list)
    load_errors: list[str] = field(default_factory=list)  # file:line:col: message; nothing ran
    coverage: dict[str, Any] | None = None  # OPA's coverage report shape (`opa test --coverage`)

    @property
    def ok(self) -> bool:
        return not self.load_errors and all(r.passed for r in self.results)

    def to_json(self) -> str:
        return json.dumps({"results": [asdict(r) for r in self.results], "load_errors": self.load_errors,
                           "coverage": self.coverage})

    @classmethod
    def from_json(cls, text: str) -> TestReport:
        doc = json.loads(text)
        results = [TestResult(**{**r, "prints": tuple(r["prints"])}) for r in doc["results"]]
        return cls(results, doc["load_errors"], doc["coverage"])


def discover(modules: Mapping[str, str]) -> Iterator[tuple[str, str, str]]:
    """(file, package, rule) of every test rule, in file order."""
    for file, text in sorted(modules.items()):
        pkg = _PACKAGE.search(text)
        if pkg is not None:
            for rule in dict.fromkeys(_TEST_RULE.findall(text)):
                yield file, pkg.group(1), rule


def run_policy_tests(modules: Mapping[str, str], data: Mapping[str, Any], coverage: bool = False) -> TestReport:
    """Load every module (policy and tests) with `data.gateway`, then evaluate each test rule on its
    own clone of the compiled engine, so a panic in one test spoils no other."""
    try:
        compiled = compile_modules(modules, {"gateway": dict(data)})
    except PolicyCompileError as e:
        return TestReport(load_errors=[str(i) for i in e.issues] or [str(e)])
    if coverage:
        compiled.set_enable_coverage(True)
    report = TestReport()
    covered: dict[str, set[int]] = {}
    missed: dict[str, set[int]] = {}
    for file, package, rule in discover(modules):
        if rule.startswith("todo_"):
            report.results.append(TestResult(file, package, rule, "SKIPPED"))
            continue
        engine = compiled.clone()  # type: ignore[attr-defined]  # (missing from the stubs)
        engine.set_gather_prints(True)
        started = time.perf_counter_ns()
        value: Any = None
        try:
            value = plain(engine.eval_rule(f"data.{package}.{rule}"))
            outcome, error = ("FAIL" if value is None or value is False else "PASS"), ""
        except RuntimeError as e:
            outcome, error = "ERROR", engine_message(e)
        except BaseException as e:
            if not is_panic(e):
                raise
            outcome, error = "ERROR", f"the Rego engine panicked: {engine_message(e)}"
        elapsed = time.perf_counter_ns() - started
        prints = tuple(engine.take_prints()) if outcome != "ERROR" else ()
        report.results.append(TestResult(file, package, rule, outcome, elapsed,
                                         None if outcome == "PASS" else value, error, prints))
        if coverage:
            for f in json.loads(engine.get_coverage_report_as_json()).get("files", []):
                covered.setdefault(f["path"], set()).update(f.get("covered", []))
                missed.setdefault(f["path"], set()).update(f.get("not_covered", []))
    if coverage:
        report.coverage = coverage_report(modules, covered, missed)
    return report


def coverage_report(modules: Mapping[str, str], covered: Mapping[str, set[int]],
                    missed: Mapping[str, set[int]]) -> dict[str, Any]:
    """OPA's coverage shape from the engine's own line sets (the statements it evaluated, and those
    no test reached): per file the covered and not-covered line ranges, counts and a percentage; and
    the totals."""
    files: dict[str, Any] = {}
    total_hit = total_miss = 0
    for file in sorted(modules):
        hit = sorted(covered.get(file, set()))
        miss = sorted(missed.get(file, set()) - set(hit))
        total_hit, total_miss = total_hit + len(hit), total_miss + len(miss)
        files[file] = {"covered": _ranges(hit), "not_covered": _ranges(miss), "covered_lines": len(hit),
                       "not_covered_lines": len(miss), "coverage": _percent(len(hit), len(hit) + len(miss))}
    return {"files": files, "covered_lines": total_hit, "not_covered_lines": total_miss,
            "coverage": _percent(total_hit, total_hit + total_miss)}


def _ranges(rows: list[int]) -> list[dict[str, dict[str, int]]]:
    out: list[dict[str, dict[str, int]]] = []
    for row in rows:
        if out and out[-1]["end"]["row"] == row - 1:
            out[-1]["end"]["row"] = row
        else:
            out.append({"start": {"row": row}, "end": {"row": row}})
    return out


def _percent(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def run_isolated(modules: Mapping[str, str], data: Mapping[str, Any], coverage: bool = False,
                 timeout_s: float = 120.0, runner: Sequence[str] = RUNNER) -> TestReport:
    """The tests' report; when the engine crashed or hung, one ERROR result saying so (a policy whose
    tests cannot run is never taken as passing)."""
    def failed(why: str) -> TestReport:
        return TestReport([TestResult("*", "*", "(all tests)", "ERROR", error=why)])

    try:
        done = subprocess.run(list(runner), capture_output=True, text=True, timeout=timeout_s,
                              input=json.dumps({"modules": dict(modules), "data": dict(data), "coverage": coverage}))
    except subprocess.TimeoutExpired:
        return failed(f"the Rego engine did not finish within {timeout_s:.0f}s")
    if done.returncode != 0:
        why = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exited with status {done.returncode}")
        return failed(f"the Rego engine crashed running the tests ({why})")
    return TestReport.from_json(done.stdout.splitlines()[-1])


def main() -> None:
    doc = json.load(sys.stdin)
    report = run_policy_tests(doc["modules"], doc["data"], bool(doc.get("coverage")))
    sys.stdout.write("\n" + report.to_json() + "\n")


if __name__ == "__main__":
    main()
