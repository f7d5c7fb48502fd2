"""The policy's Rego tests, run in a process of their own: regopy 1.5 can crash the process
(SIGSEGV) evaluating some tests (`with input as` over a rule that calls a built-in), and that must
take down neither ext_proc (a reload that runs the tests) nor `llmgw policy test` without a word.

`python -m extproc.config.policy_tests` reads {"modules": {name: text}, "data": {...}} on stdin and
writes the results as JSON; `run_isolated` is the caller's side.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from extproc.config.policy import RuleResult, run_policy_tests

RUNNER = (sys.executable, "-m", "extproc.config.policy_tests")


def run_isolated(modules: Mapping[str, str], data: Mapping[str, Any], timeout_s: float = 120.0,
                 runner: Sequence[str] = RUNNER) -> list[RuleResult]:
    """The tests' results; when the engine crashed or hung, one failed result saying so (a policy
    whose tests cannot run is never taken as passing)."""
    try:
        done = subprocess.run(list(runner),
                              input=json.dumps({"modules": dict(modules), "data": dict(data)}),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [RuleResult("*", "(all tests)", False, f"the Rego engine did not finish within {timeout_s:.0f}s")]
    if done.returncode != 0:
        why = (f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0
               else f"exited with status {done.returncode}")
        return [RuleResult("*", "(all tests)", False, f"the Rego engine crashed running the tests ({why})")]
    return [RuleResult(**r) for r in json.loads(done.stdout.splitlines()[-1])]


def main() -> None:
    doc = json.load(sys.stdin)
    results = run_policy_tests(doc["modules"], doc["data"])
    sys.stdout.write("\n" + json.dumps([asdict(r) for r in results]) + "\n")


if __name__ == "__main__":
    main()
