"""The Rego engine behind the gateway: regorus (Microsoft's Rust implementation of OPA's Rego, the
`celine-regorus` build on PyPI). The only module that imports it.

Chosen by measurement (docs/POLICY_ENGINE.md: OPA's own conformance cases, crashes, evaluation time):
it evaluates `with input as` / `with data.x as` over rules that call built-ins (regopy 1.5 crashed
the process there), names file, line and column for syntax errors, unsafe variables and conflicts,
raises an error for an unknown function instead of evaluating it as undefined, and one decision
costs ~35 us against regopy's ~260 us.

What it does not do, and how the gateway lives with it:
- a Rust panic in a built-in (`strings.count` with an empty needle) arrives as `PanicException`, a
  BaseException, and leaves that engine unusable: every evaluation therefore runs on a clone of the
  compiled engine (0.3 us; the compiled modules are shared), and a panic is an evaluation error;
- unknown functions are errors only when reached: `unknown_calls` (rego_check.py) refuses them when
  the policy loads, with `is_builtin` below asking the engine which names it implements;
- `http.send` exists but evaluates as undefined with no error (no network here): a deny rule on it
  would never fire, so a policy calling it is refused (NOT_EVALUATED);
- `with <built-in> as` (mocking a built-in in a test) is not supported: the test fails with an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import regorus

from extproc.config.rego_check import RegoIssue, calls, position, unknown_calls

ENGINE = "regorus"
ENGINE_PACKAGE = "celine-regorus"

# Built-ins the engine accepts but cannot evaluate here: calling one is refused when the policy loads.
NOT_EVALUATED = {"http.send": "network calls from policy are not evaluated by this engine (it would "
                              "evaluate as undefined, and a deny rule using it would never fire)"}

_LOCATION = re.compile(r"-->\s*(?P<file>[^\s:]+):(?P<line>\d+):(?P<col>\d+)")
_MESSAGE = re.compile(r"^error:\s*(?P<msg>.*)$", re.M)


class PolicyCompileError(Exception):
    """The policy does not compile, or calls what the engine would not evaluate; each issue names
    file, line and column where the engine or the check says where."""

    def __init__(self, message: str, issues: list[RegoIssue] | None = None):
        super().__init__(message)
        self.issues = issues or []


class PolicyEvaluationError(Exception):
    """The policy ran but produced no usable value (an error, a panic): the caller must fail closed."""


def engine_message(error: BaseException) -> str:
    """The engine's error without the Rust backtrace it appends when RUST_BACKTRACE is set."""
    return str(error).split("\nStack backtrace:")[0].strip()


def engine_issues(error: BaseException, modules: Mapping[str, str], fallback_file: str = "*.rego") -> list[RegoIssue]:
    """The engine's error (`--> file:line:col`, the source line with a caret, `error: message`) as
    located issues; a message with no location keeps the fallback file and 0:0."""
    text = engine_message(error)
    where, what = _LOCATION.search(text), _MESSAGE.search(text)
    message = what.group("msg").strip() if what else text.splitlines()[-1] if text else "error"
    if where is None:
        return [RegoIssue(fallback_file, 0, 0, message)]
    file, line = where.group("file"), int(where.group("line"))
    lines = modules.get(file, "").splitlines()
    column = _char_column(lines[line - 1] if 0 < line <= len(lines) else "", int(where.group("col")))
    return [RegoIssue(file, line, column, message)]


def _char_column(line: str, shown: int) -> int:
    """The engine counts a tab as four columns; OPA and editors count characters."""
    col = 1
    for i, ch in enumerate(line):
        if col >= shown:
            return i + 1
        col += 4 if ch == "\t" else 1
    return len(line) + 1 if col >= shown else shown


def is_panic(error: BaseException) -> bool:
    return type(error).__name__ == "PanicException"


@lru_cache(maxsize=1024)
def is_builtin(name: str) -> bool:
    """Whether the engine implements a built-in of this name (asked by calling it with no arguments:
    a missing one is 'could not find function', an existing one complains about its arguments)."""
    probe = regorus.Engine()
    try:
        probe.add_policy("probe.rego", f"package probe\nx := {name}()\n")
        probe.eval_rule("data.probe.x")
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return "could not find function" not in engine_message(e)
    return True


def compile_modules(modules: Mapping[str, str], data: Mapping[str, Any]) -> regorus.Engine:
    """One engine holding every module and the data document, checked as far as loading can check:
    syntax, unsafe variables and rule conflicts (the engine's analysis, forced here rather than at the
    first request), calls of functions nobody implements, and built-ins the engine does not evaluate."""
    issues = unknown_calls(modules, is_builtin)
    for file, text in sorted(modules.items()):
        for name, offset, head in calls(text):
            if name in NOT_EVALUATED and not head:
                issues.append(RegoIssue(file, *position(text, offset), f"`{name}`: {NOT_EVALUATED[name]}"))
    engine = regorus.Engine()
    for name, text in sorted(modules.items()):
        try:
            engine.add_policy(name, text)
        except RuntimeError as e:
            issues.extend(engine_issues(e, modules, name))
    if not issues:
        engine.add_data_json(json.dumps(dict(data)))
        try:
            engine.eval_query("true")  # runs the analysis: unsafe variables, recursion, conflicts
        except RuntimeError as e:
            issues.extend(engine_issues(e, modules))
    if issues:
        raise PolicyCompileError("; ".join(map(str, issues)), issues)
    return engine


def evaluate(compiled: regorus.Engine, path: str, input_doc: Any) -> Any:
    """The value of `path` (`data.pkg.rule`) for this input, evaluated on a clone of the compiled
    engine; None when undefined. An engine error or panic raises PolicyEvaluationError."""
    engine = compiled.clone()  # type: ignore[attr-defined]  # (missing from the stubs)
    try:
        engine.set_input_json(json.dumps(input_doc))  # as JSON: the dict form turns integers into floats
        return plain(engine.eval_rule(path))
    except RuntimeError as e:
        raise PolicyEvaluationError(engine_message(e)) from None
    except BaseException as e:
        if is_panic(e):
            raise PolicyEvaluationError(f"the Rego engine panicked: {engine_message(e)}") from None
        raise


def plain(value: Any) -> Any:
    """A value as JSON holds it: the engine returns Rego sets as Python sets (sorted lists here) and
    every number as a float (integral ones become ints again; beyond 2**53 they are approximate)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
