"""The Rego authorization policy (package `llmgw.authz`), compiled once per config revision.

The policy files are built into one regopy bundle with the gateway's static facts as `data.gateway`;
a request then costs one `set_input` and one bundle query (about 0.1 ms), never a parse or a compile.
Files ending in `_test.rego` are the policy's tests (`llmgw policy test`) and stay out of the bundle.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import regopy

from extproc.config.rego_check import RegoIssue, located_errors, unknown_calls

# Built-ins whose value changes between two evaluations of the same input: a policy using one is
# never served from the decision cache.
_IMPURE = re.compile(r"\b(time\.|http\.send|rand\.|uuid\.|opa\.runtime|crypto\.x509|net\.lookup)")
CACHE_SIZE = 4096
DECISION_CACHE = True  # ext_proc's --no-decision-cache turns it off (benchmarks measure both)

PACKAGE = "llmgw.authz"
ENTRYPOINT = "llmgw/authz/decision"
QUERY = "x = data.llmgw.authz.decision"


class PolicyCompileError(Exception):
    """The policy does not compile, or calls what the engine would evaluate as undefined; each issue
    names file, line and column where the engine or the check says where."""

    def __init__(self, message: str, issues: list[RegoIssue] | None = None):
        super().__init__(message)
        self.issues = issues or []


class PolicyEvaluationError(Exception):
    """The policy ran but produced no usable decision: the caller must fail closed."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One authorization decision, as recorded for the ledger: never with request content."""

    allow: bool
    reasons: tuple[str, ...]
    redact: tuple[str, ...]  # entity types to replace with placeholders before dispatch
    record_content: bool  # the policy's half of the logging decision (the route holds the other)
    policy_revision: str


def is_test_module(name: str) -> bool:
    return name.endswith("_test.rego")


def _compile_error(error: regopy.RegoError, modules: Mapping[str, str], fallback: str) -> PolicyCompileError:
    issues = located_errors(str(error), modules)
    return PolicyCompileError("; ".join(map(str, issues)) or fallback, issues)


def check_calls(modules: Mapping[str, str]) -> None:
    """Refuse a policy that calls a built-in regopy does not implement or a function nobody defines
    (extproc/config/rego_check.py): it would evaluate as undefined, and a deny rule would not fire."""
    issues = unknown_calls(modules, regopy.Interpreter().is_builtin)
    if issues:
        raise PolicyCompileError("; ".join(map(str, issues)), issues)


def _interpreter(modules: Mapping[str, str], data: Mapping[str, Any]) -> regopy.Interpreter:
    rego = regopy.Interpreter()
    rego.add_data_json(json.dumps({"gateway": dict(data)}))
    for name, text in sorted(modules.items()):
        try:
            rego.add_module(name, text)
        except regopy.RegoError as e:
            raise _compile_error(e, {name: text}, f"{name}: {e}") from None
    return rego


class CompiledPolicy:
    """The bundle plus the interpreter that runs it. Not thread-safe: each ext_proc worker is one
    event loop, and a query never awaits."""

    def __init__(self, modules: Mapping[str, str], data: Mapping[str, Any], revision: str):
        policy = {k: v for k, v in modules.items() if not is_test_module(k)}
        if not any(f"package {PACKAGE}" in text for text in policy.values()):
            raise PolicyCompileError(f"no Rego module declares `package {PACKAGE}`: every request would be "
                                     "denied")
        check_calls(policy)
        try:
            self._bundle = _interpreter(policy, data).build(QUERY, [ENTRYPOINT])
        except regopy.RegoError as e:
            raise _compile_error(e, policy, str(e)) from None
        if not self._bundle.ok():
            raise PolicyCompileError("the policy bundle did not build")
        self._run = regopy.Interpreter()
        self.revision = revision
        # A pure policy's decision is a function of its input (data is fixed per revision), so equal
        # inputs share one evaluation: most requests repeat tenant, route, class and tools.
        self.cacheable = DECISION_CACHE and not any(_IMPURE.search(text) for text in policy.values())
        self._cache: OrderedDict[str, Decision] = OrderedDict()

    def decide(self, input_doc: Mapping[str, Any]) -> Decision:
        """The decision for this input: from the cache when the policy is pure, else evaluated."""
        if not self.cacheable:
            return self.evaluate(input_doc)
        key = json.dumps(input_doc, sort_keys=True, separators=(",", ":"))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        decision = self.evaluate(input_doc)
        self._cache[key] = decision
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return decision

    def evaluate(self, input_doc: Mapping[str, Any]) -> Decision:
        """Evaluate `data.llmgw.authz.decision`. Any error, an undefined decision or one of the wrong
        shape raises PolicyEvaluationError: never an implicit allow."""
        try:
            self._run.set_input(regopy.Input(input_doc))
            out = self._run.query_bundle_entrypoint(self._bundle, ENTRYPOINT)
            if not out.ok():
                raise PolicyEvaluationError("the policy query failed")
            doc = json.loads(str(out))
        except (regopy.RegoError, ValueError) as e:
            raise PolicyEvaluationError(f"policy evaluation failed: {e}") from None
        try:
            (value,) = doc["expressions"]
            allow = value["allow"]
            reasons = value.get("reasons", [])
            obligations = value.get("obligations", {})
            redact = obligations.get("redact", [])
            record = obligations.get("record_content", False)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PolicyEvaluationError("the policy returned no decision object") from None
        if (not isinstance(allow, bool) or not isinstance(record, bool)
                or not all(isinstance(r, str) for r in reasons) or not all(isinstance(r, str) for r in redact)):
            raise PolicyEvaluationError("the policy's decision has the wrong shape")
        return Decision(allow, tuple(sorted(reasons)), tuple(sorted(redact)), record, self.revision)


@dataclass(frozen=True)
class RuleResult:
    module: str
    rule: str
    passed: bool
    error: str = ""


def run_policy_tests(modules: Mapping[str, str], data: Mapping[str, Any]) -> list[RuleResult]:
    """Evaluate every `test_*` rule, as `opa test` does: a rule passes when it is defined and true.
    A rule `test_X` runs with the package's `input_X` as its input document when one exists: regopy
    1.5 cannot evaluate `with input as` over rules that call built-ins, so tests state their input
    beside them instead. Policy and test modules load together, so tests see the real rules."""
    rego = _interpreter(modules, data)
    results = []
    for name, text in sorted(modules.items()):
        pkg = re.search(r"^package\s+([\w.]+)", text, re.M)
        if pkg is None:
            continue
        for rule in dict.fromkeys(re.findall(r"^(test_\w+)\b", text, re.M)):
            given = f"input_{rule.removeprefix('test_')}"
            try:
                doc = _query(rego, f"data.{pkg.group(1)}.{given}") if re.search(
                    rf"^{given}\b", text, re.M) else None
                rego.set_input(regopy.Input(doc if isinstance(doc, dict) else {}))
                results.append(RuleResult(name, rule, _query(rego, f"data.{pkg.group(1)}.{rule}") is True))
            except PolicyEvaluationError as e:
                results.append(RuleResult(name, rule, False, str(e)))
    return results


def _query(rego: regopy.Interpreter, ref: str) -> Any:
    """The value of one reference; None when undefined. (A failed output is never printed: regopy
    1.5 crashes rendering one.)"""
    out = rego.query(f"x = {ref}")
    if not out.ok():
        raise PolicyEvaluationError(f"{ref} failed to evaluate")
    text = str(out)
    if text == "undefined":
        return None
    return json.loads(text)["bindings"]["x"]
