"""The Rego authorization policy (package `llmgw.authz`), compiled once per config revision.

The policy files are loaded into one engine (extproc/config/rego_engine.py) with the gateway's static
facts as `data.gateway`; a request then costs one evaluation on a clone of it (~35 us), never a parse
or a compile. Files ending in `_test.rego` are the policy's tests (`llmgw policy test`) and stay out of
the enforced policy.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.config.rego_engine import PolicyCompileError, PolicyEvaluationError, compile_modules, evaluate

__all__ = ["CompiledPolicy", "Decision", "PolicyCompileError", "PolicyEvaluationError", "is_test_module"]

# Built-ins whose value changes between two evaluations of the same input: a policy using one is
# never served from the decision cache.
_IMPURE = re.compile(r"\b(time\.|rand\.|uuid\.|opa\.runtime|crypto\.x509|net\.lookup)")
CACHE_SIZE = 4096
DECISION_CACHE = True  # ext_proc's --no-decision-cache turns it off (benchmarks measure both)

PACKAGE = "llmgw.authz"
DECISION_PATH = "data.llmgw.authz.decision"
# Returned tool calls (extproc/answer_checks.py): optional; a policy without it decides no call.
CALLS_PACKAGE = "llmgw.answers"
CALL_DECISION_PATH = "data.llmgw.answers.decision"


@dataclass(frozen=True, slots=True)
class Decision:
    """One authorization decision, as recorded for the ledger: never with request content."""

    allow: bool
    reasons: tuple[str, ...]
    redact: tuple[str, ...]  # entity types to replace with placeholders before dispatch
    record_content: bool  # the policy's half of the logging decision (the route holds the other)
    policy_revision: str


def cache_key(input_doc: Mapping[str, Any]) -> bytes:
    """The input as canonical JSON: equal inputs, equal keys (orjson: ~10x the standard library)."""
    return orjson.dumps(input_doc, option=orjson.OPT_SORT_KEYS)


def is_test_module(name: str) -> bool:
    return name.endswith("_test.rego")


class CompiledPolicy:
    """The compiled policy; each evaluation runs on a clone of it, so an engine panic spoils nothing
    shared. Each ext_proc worker is one event loop, and an evaluation never awaits."""

    def __init__(self, modules: Mapping[str, str], data: Mapping[str, Any], revision: str):
        policy = {k: v for k, v in modules.items() if not is_test_module(k)}
        if not any(re.search(rf"^package\s+{re.escape(PACKAGE)}\s*$", t, re.M) for t in policy.values()):
            raise PolicyCompileError(f"no Rego module declares `package {PACKAGE}`: every request would be "
                                     "denied")
        self._engine = compile_modules(policy, {"gateway": dict(data)})
        self.revision = revision
        self.decides_calls = any(re.search(rf"^package\s+{re.escape(CALLS_PACKAGE)}\s*$", t, re.M)
                                 for t in policy.values())
        # A pure policy's decision is a function of its input (data is fixed per revision), so equal
        # inputs share one evaluation: most requests repeat tenant, route, class and tools.
        self.cacheable = DECISION_CACHE and not any(_IMPURE.search(text) for text in policy.values())
        self._cache: OrderedDict[bytes, Decision] = OrderedDict()

    def decide(self, input_doc: Mapping[str, Any], key: bytes | None = None) -> Decision:
        """The decision for this input: from the cache when the policy is pure, else evaluated.
        `key` (cache_key of the input) may be passed when another policy already computed it."""
        if not self.cacheable:
            return self.evaluate(input_doc)
        key = key or cache_key(input_doc)
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
        value = evaluate(self._engine, DECISION_PATH, dict(input_doc))
        try:
            allow = value["allow"]
            reasons = value.get("reasons", [])
            obligations = value.get("obligations", {})
            redact = obligations.get("redact", [])
            record = obligations.get("record_content", False)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PolicyEvaluationError("the policy returned no decision object") from None
        if (not isinstance(allow, bool) or not isinstance(record, bool)
                or not isinstance(reasons, (list, set)) or not isinstance(redact, (list, set))
                or not all(isinstance(r, str) for r in reasons) or not all(isinstance(r, str) for r in redact)):
            raise PolicyEvaluationError("the policy's decision has the wrong shape")
        return Decision(allow, tuple(sorted(reasons)), tuple(sorted(redact)), record, self.revision)

    def call_decision(self, input_doc: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        """Evaluate `data.llmgw.answers.decision` for one tool call a model returned: (allow, reasons).
        Like the request's decision it is never an implicit allow: an error, an undefined decision or
        one of the wrong shape raises PolicyEvaluationError. Not cached: a call's arguments are the
        model's, rarely repeated."""
        value = evaluate(self._engine, CALL_DECISION_PATH, dict(input_doc))
        allow = value.get("allow") if isinstance(value, dict) else None
        reasons = value.get("reasons", []) if isinstance(value, dict) else None
        if not isinstance(allow, bool) or not isinstance(reasons, (list, set)) \
                or not all(isinstance(r, str) for r in reasons):
            raise PolicyEvaluationError("the policy's call decision has the wrong shape")
        return allow, tuple(sorted(reasons))
