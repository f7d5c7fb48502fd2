"""Answers checked after generation: what a request offered and asked for, held against what came back.

A request that offers tools or asks for a JSON answer carries a `CheckSpec` from the decision to the
filter that reads its answer (extproc/settlement/meter.py for JSON, extproc/service/streams.py's guard for
streams). There each tool call must name a tool the request offered, its arguments must parse as a
JSON object and satisfy the tool's parameter schema, and the policy (package `llmgw.answers`) decides
its effect with its arguments; a `json_object` answer must parse as one JSON object and a
`json_schema` answer must satisfy the schema the request sent.

A failure names its check and where in the answer it is, never the content: a check's name is a
metric label, and the reason reaches the client, the ledger and the logs.

Schemas are the caller's: compiled once per distinct schema (an LRU of validators), in the dialect
they declare (`$schema`, else 2020-12), with `pattern` and `patternProperties` matched by RE2 so a
caller's regular expression cannot hold a worker for seconds on a model's output. References are
resolved only inside the schema: nothing is ever fetched.
"""

from __future__ import annotations

import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any, Literal

import jsonschema
import orjson
import re2
import referencing.exceptions
from jsonschema import validators
from jsonschema.exceptions import SchemaError, ValidationError

from extproc.chat import invalid
from extproc.config.rego_engine import PolicyEvaluationError
from extproc.contract import ErrorCode, GatewayError
from extproc.redact import log_safe
from extproc.tool_catalog import ToolFacts

CheckMode = Literal["enforce", "report"]
ANSWER_REJECTED = ErrorCode.ANSWER_REJECTED.value  # the ledger's termination of an answer the checks refused


class Check(StrEnum):
    """The checks an answer can fail (a metric label: a fixed, small set)."""

    TOOL_OFFERED = "tool_offered"  # the call names a tool the request offered
    TOOL_ARGUMENTS_JSON = "tool_arguments_json"  # its arguments parse as a JSON object
    TOOL_ARGUMENTS_SCHEMA = "tool_arguments_schema"  # and satisfy the tool's parameter schema
    TOOL_CALL_POLICY = "tool_call_policy"  # the policy allows the call's effect with these arguments
    FORMAT_JSON = "format_json"  # a JSON answer (json_object, json_schema) parses as one JSON object
    FORMAT_SCHEMA = "format_schema"  # a json_schema answer satisfies the request's schema


@dataclass(frozen=True, slots=True)
class Failure:
    check: Check
    where: str  # a path into the internal answer, e.g. choices[0].message.tool_calls[1]
    why: str = ""  # the schema keyword and its place in the caller's schema, or the policy's reasons

    def text(self) -> str:
        return f"{self.check.value} at {self.where}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked, as the call policy sees them (the authorization input's identity and request)."""

    tenant: str
    subject: str
    kind: str
    groups: tuple[str, ...]
    effects: tuple[str, ...]
    data_class: str
    route: str
    request_class: str


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    schema: Any  # the offered `parameters` ({} when none: any object)
    strict: bool
    known: bool  # in the gateway's tool catalog
    effects: tuple[str, ...]  # the catalog's effects of the tool


@dataclass(frozen=True, slots=True)
class CheckSpec:
    """What a request's answer is checked against, as the decision wrote it for the answer's filter."""

    mode: CheckMode
    caller: Caller
    tools: Mapping[str, Tool] = field(default_factory=dict)
    format: Literal["", "json_object", "json_schema"] = ""
    schema: Any = None
    strict: bool = False
    # Candidates whose translation lost `response_format` (a route that reports losses served it without):
    # their answers' text is not held to a format they were never asked for.
    format_lost: tuple[str, ...] = ()

    def answered_by(self, deployment: Any) -> CheckSpec:
        """The checks of the answer this deployment (config.schema.Deployment, or None) gave."""
        lost = deployment is not None and deployment.deployment in self.format_lost
        return replace(self, format="", schema=None) if lost else self

    def encode(self) -> str:
        c = self.caller
        return orjson.dumps({
            "m": self.mode,
            "c": [c.tenant, c.subject, c.kind, list(c.groups), list(c.effects), c.data_class, c.route,
                  c.request_class],
            "t": [[t.name, t.schema, t.strict, t.known, list(t.effects)] for t in self.tools.values()],
            "f": self.format, "s": self.schema, "x": self.strict, "l": list(self.format_lost)}).decode()

    @staticmethod
    def decode(text: str) -> CheckSpec:
        d = orjson.loads(text)
        c = d["c"]
        tools = {t[0]: Tool(t[0], t[1], bool(t[2]), bool(t[3]), tuple(t[4])) for t in d["t"]}
        return CheckSpec(d["m"], Caller(c[0], c[1], c[2], tuple(c[3]), tuple(c[4]), c[5], c[6], c[7]), tools,
                         d["f"], d["s"], bool(d["x"]), tuple(d.get("l", ())))


def spec_for(body: Mapping[str, Any], mode: CheckMode, caller: Caller,
             offered: Mapping[str, ToolFacts]) -> CheckSpec | None:
    """The checks a chat request's answer gets: None when it offers no tools and asks for no JSON.
    A tool's parameters or a response schema that is not a JSON Schema is the caller's 400 here,
    before anything is spent."""
    tools: dict[str, Tool] = {}
    for i, t in enumerate(body.get("tools") or ()):
        fn = t["function"]
        params = fn.get("parameters")
        schema = {} if params is None else params
        _checked_schema(schema, f"tools[{i}].function.parameters")
        # As the offer was authorized (extproc/tool_catalog.py); every offered name is resolved there.
        facts = offered.get(fn["name"]) or ToolFacts(fn["name"], False, (), None)
        tools[fn["name"]] = Tool(fn["name"], schema, fn.get("strict") is True, facts.known, facts.effects)
    fmt = body.get("response_format") or {}
    kind = fmt.get("type", "text")
    schema, strict = None, False
    if kind == "json_schema":
        js = fmt["json_schema"]
        schema = js.get("schema", {})
        _checked_schema(schema, "response_format.json_schema.schema")
        strict = js.get("strict") is True
    if not tools and kind not in ("json_object", "json_schema"):
        return None
    return CheckSpec(mode, caller, tools, kind if kind != "text" else "", schema, strict)


# -- schemas ------------------------------------------------------------------------------------------

def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if isinstance(instance, str) and not _re2(pattern).search(instance):
        yield ValidationError("does not match the schema's pattern")


def _re2_pattern_properties(validator: Any, patterns: Mapping[str, Any], instance: Any,
                            schema: Any) -> Iterator[ValidationError]:
    if not isinstance(instance, dict):
        return
    for pattern, subschema in patterns.items():
        compiled = _re2(pattern)
        for k, v in instance.items():
            if compiled.search(k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


_re2 = lru_cache(maxsize=1024)(re2.compile)  # a schema's patterns, compiled once each


def _validator_class(schema: Any) -> Any:
    base = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return validators.extend(base, {"pattern": _re2_pattern, "patternProperties": _re2_pattern_properties})


_VALIDATORS: OrderedDict[bytes, Any] = OrderedDict()
VALIDATOR_CACHE = 512


def validator(schema: Any, strict: bool = False) -> Any:
    """The compiled validator of a schema (its canonical JSON the key). Under `strict` an object that
    lists `properties` and says nothing of others takes no others (the provider's strict mode closes
    them; so does the check)."""
    key = orjson.dumps([schema, strict], option=orjson.OPT_SORT_KEYS)
    hit = _VALIDATORS.get(key)
    if hit is not None:
        _VALIDATORS.move_to_end(key)
        return hit
    cls = _validator_class(schema)
    made = cls(closed(schema) if strict else schema)
    _VALIDATORS[key] = made
    if len(_VALIDATORS) > VALIDATOR_CACHE:
        _VALIDATORS.popitem(last=False)
    return made


def closed(schema: Any) -> Any:
    """The schema with every object that lists `properties` closed to others, unless it says otherwise."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _checked_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"`{param}` must be a JSON Schema (an object)", param)
    key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    if key in _SOUND:
        return
    try:
        cls = _validator_class(schema)
        cls.check_schema(schema)
        for pattern in _patterns(schema):
            re2.compile(pattern)
        for ref in _refs(schema):
            if not _resolves(schema, ref):
                raise invalid(f"`{param}` holds a reference that does not resolve inside it ({ref[:64]}): "
                              "references are not fetched", param)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise invalid(f"`{param}` is not a valid JSON Schema ({e.validator} at /{where})", param) from None
    except (re2.error, TypeError, ValueError):
        raise invalid(f"`{param}` holds a pattern the gateway cannot match (RE2 syntax)", param) from None
    except jsonschema.exceptions.UnknownType:
        raise invalid(f"`{param}` names an unknown type", param) from None
    if len(_SOUND) > 4096:
        _SOUND.clear()
    _SOUND.add(key)


_SOUND: set[bytes] = set()  # schemas already found valid (canonical JSON)


def _objects(schema: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a schema, itself included, at any depth (inside objects and arrays)."""
    if isinstance(schema, list):
        for s in schema:
            yield from _objects(s)
    elif isinstance(schema, dict):
        yield schema
        for v in schema.values():
            if isinstance(v, (dict, list)):
                yield from _objects(v)


def _named(schema: Any, *keys: str) -> Iterator[str]:
    """Every string value of these keywords anywhere in a schema."""
    return (o[k] for o in _objects(schema) for k in keys if isinstance(o.get(k), str))


def _refs(schema: Any) -> Iterator[str]:
    """Every `$ref` and `$dynamicRef` in a schema."""
    return _named(schema, "$ref", "$dynamicRef")


def _resolves(schema: Any, ref: str) -> bool:
    """Whether a reference names a place inside the schema itself: `#`, a JSON pointer (`#/$defs/x`) or
    an `$anchor` (`#name`). Anything else would have to be fetched, which the checks never do."""
    if not ref.startswith("#"):
        return False
    fragment = urllib.parse.unquote(ref[1:])
    if not fragment.startswith("/"):
        return fragment == "" or fragment in _anchors(schema)
    at: Any = schema
    for part in fragment[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(at, dict) and part in at:
            at = at[part]
        elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
            at = at[int(part)]
        else:
            return False
    return True


def _anchors(schema: Any) -> set[str]:
    return set(_named(schema, "$anchor", "$dynamicAnchor"))


def _patterns(schema: Any) -> Iterator[str]:
    """Every regular expression a schema holds: `pattern` values and `patternProperties` keys."""
    for o in _objects(schema):
        if isinstance(o.get("pattern"), str):
            yield o["pattern"]
        if isinstance(o.get("patternProperties"), dict):
            yield from o["patternProperties"]


def schema_failure(schema: Any, strict: bool, value: Any) -> str | None:
    """None when `value` satisfies the schema, else the first failing keyword and where it stands in
    the caller's schema (never the value)."""
    try:
        error = jsonschema.exceptions.best_match(validator(schema, strict).iter_errors(value))
    except referencing.exceptions.Unresolvable:  # (intake refuses such schemas; never an unchecked pass)
        return "a reference that does not resolve"
    if error is None:
        return None
    where = "/".join(str(p) for p in list(error.schema_path)[:-1])
    return f"schema keyword {error.validator} at /{where}"


# -- the checks ---------------------------------------------------------------------------------------

# The policy's verdict on one returned call: (allowed, reasons). None when no policy decides calls.
CallPolicy = Callable[[Mapping[str, Any]], tuple[bool, tuple[str, ...]]]


def call_input(spec: CheckSpec, tool: Tool, arguments: Any) -> dict[str, Any]:
    """The call policy's input (policy/README.md): who asked, on which route, and the call."""
    c = spec.caller
    return {
        "identity": {"tenant": c.tenant, "subject": c.subject, "kind": c.kind, "groups": list(c.groups),
                     "effects": list(c.effects)},
        "request": {"route": c.route, "request_class": c.request_class, "data_class": c.data_class},
        "call": {"name": tool.name, "known": tool.known, "effects": list(tool.effects), "arguments": arguments},
    }


def check_call(spec: CheckSpec, name: Any, arguments: Any, where: str,
               policy: CallPolicy | None) -> Failure | None:
    """One returned tool call: offered, arguments a JSON object satisfying its schema, allowed."""
    tool = spec.tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return Failure(Check.TOOL_OFFERED, where)
    try:
        args = orjson.loads(arguments) if isinstance(arguments, str) else None
    except orjson.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        return Failure(Check.TOOL_ARGUMENTS_JSON, where)
    why = schema_failure(tool.schema, tool.strict, args)
    if why is not None:
        return Failure(Check.TOOL_ARGUMENTS_SCHEMA, where, why)
    if policy is not None:
        allowed, reasons = policy(call_input(spec, tool, args))
        if not allowed:
            return Failure(Check.TOOL_CALL_POLICY, where, "; ".join(reasons[:4]) or "denied by policy")
    return None


def check_content(spec: CheckSpec, content: Any, where: str) -> Failure | None:
    """A JSON answer's text: one JSON object, satisfying the request's schema when it sent one."""
    if not spec.format:
        return None
    try:
        doc = orjson.loads(content) if isinstance(content, str) else None
    except orjson.JSONDecodeError:
        doc = None
    if spec.format == "json_object" and not isinstance(doc, dict):
        return Failure(Check.FORMAT_JSON, where)
    if spec.format == "json_schema":
        if doc is None and content != "null":
            return Failure(Check.FORMAT_JSON, where)
        why = schema_failure(spec.schema, spec.strict, doc)
        if why is not None:
            return Failure(Check.FORMAT_SCHEMA, where, why)
    return None


def check_completion(doc: Any, spec: CheckSpec, policy: CallPolicy | None) -> list[Failure]:
    """Every check of a chat completion (the internal shape). A choice that answers with tool calls is
    checked call by call; its text, if the request asked for JSON, is checked when it has any and the
    choice did not stop to call tools."""
    failures: list[Failure] = []
    for i, choice in enumerate(doc.get("choices") or () if isinstance(doc, dict) else ()):
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        calls = message.get("tool_calls") or ()
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            fn = call.get("function") if isinstance(call, dict) else None
            fn = fn if isinstance(fn, dict) else {}
            failure = cut(check_call(spec, fn.get("name"), fn.get("arguments"),
                                     f"choices[{i}].message.tool_calls[{j}]", policy), choice.get("finish_reason"),
                          choice.get("stop_reason"))
            if failure is not None:
                failures.append(failure)
        if spec.format and not calls and choice.get("finish_reason") != "tool_calls":
            failure = cut(check_content(spec, message.get("content"), f"choices[{i}].message.content"),
                          choice.get("finish_reason"), choice.get("stop_reason"))
            if failure is not None:
                failures.append(failure)
    return failures


# What a token limit leaves unfinished: the JSON of a call's arguments or of the answer's text.
TRUNCATED = (Check.TOOL_ARGUMENTS_JSON, Check.FORMAT_JSON)


def cut(failure: Failure | None, finish_reason: Any, stop_reason: Any = None) -> Failure | None:
    """None when the failure is only the answer's end where the caller asked it to end: at its token
    limit (`length`: the limit the caller set, or the route's cap) or at one of its stop sequences
    (`stop` with the sequence or token that matched as `stop_reason`, as vLLM and the answer filters
    name it; a natural end has none). Not the model but the caller left the JSON unfinished, and every
    provider answers that as the truncation it is - the finish reason says so (`length`, a door's
    `max_tokens`, `MAX_TOKENS`; `stop`, `stop_sequence`), and the partial call or text is the caller's to
    complete or discard. Refused as a 502 it was retried by the SDKs and paid for again."""
    asked = finish_reason == "length" or (
        finish_reason == "stop" and isinstance(stop_reason, str | int) and not isinstance(stop_reason, bool)
        and stop_reason != "")
    if failure is not None and asked and failure.check in TRUNCATED:
        return None
    return failure


def checks_run(spec: CheckSpec | None, policy: CallPolicy | None) -> tuple[str, ...]:
    """The checks a request's answer gets (the ledger's `answer_checks.run`)."""
    if spec is None:
        return ()
    run: list[Check] = []
    if spec.tools:
        run += [Check.TOOL_OFFERED, Check.TOOL_ARGUMENTS_JSON, Check.TOOL_ARGUMENTS_SCHEMA]
        if policy is not None:
            run.append(Check.TOOL_CALL_POLICY)
    if spec.format:
        run.append(Check.FORMAT_JSON)
        if spec.format == "json_schema":
            run.append(Check.FORMAT_SCHEMA)
    return tuple(c.value for c in run)


def summary(failures: Iterable[Failure]) -> str:
    """The failed checks' names, once each, in order (x-llmgw-answer-checks, the error's message)."""
    seen: dict[str, None] = {}
    for f in failures:
        seen.setdefault(f.check.value, None)
    return ",".join(seen)


def call_policy(policy: Any) -> CallPolicy | None:
    """The compiled policy's call decision (config/policy.py), or None when it declares no
    `llmgw.answers` package. An evaluation that fails is a refusal: never an implicit allow."""
    if policy is None or not getattr(policy, "decides_calls", False):
        return None

    def decide(doc: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
        try:
            allowed, reasons = policy.call_decision(doc)
            return bool(allowed), tuple(reasons)
        except PolicyEvaluationError:
            return False, ("the policy could not be evaluated",)
    return decide


def is_completion(doc: Any) -> bool:
    """Whether a 2xx JSON answer is a chat completion at all: an object with a list of choices, each an
    object with a message object (an HTML page, `{}` or a bare string is the upstream's broken answer)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return False
    return all(isinstance(c, dict) and isinstance(c.get("message"), dict) for c in doc["choices"])


def finish_reasons(doc: Any) -> tuple[str, ...]:
    """Each choice's finish reason as the answer gives it ("" where it gives none)."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    return tuple(str(c.get("finish_reason") or "") if isinstance(c, dict) else ""
                 for c in (choices if isinstance(choices, list) else ()))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the checks made of one answer: its failures, whether it was no answer at all (`broken`),
    and the facts the ledger keeps of it (each choice's finish reason, the upstream's own id)."""

    spec: CheckSpec | None  # None: an answer read but not checked (an idempotent one)
    failures: tuple[Failure, ...] = ()
    broken: bool = False
    finish: tuple[str, ...] = ()
    upstream_id: str = ""
    upstream_model: str = ""
    run: tuple[str, ...] = ()  # the checks it got (checks_run), for the ledger

    @property
    def rejected(self) -> bool:
        """The client does not get this answer: it is broken, or failed a check the route enforces."""
        return self.broken or (bool(self.failures) and self.spec is not None and self.spec.mode == "enforce")

    def error(self) -> GatewayError:
        if self.broken:
            return GatewayError(ErrorCode.UPSTREAM_ERROR, "the upstream's answer is not a chat completion")
        return GatewayError(ErrorCode.ANSWER_REJECTED, "the answer failed the gateway's checks: "
                            + "; ".join(f.text() for f in self.failures[:4]))

    def ledger(self) -> dict[str, Any]:
        """The ledger's `answer_checks`: the mode, the checks run, each failure (check and place; its
        reason made log-safe: a policy may quote the model's arguments)."""
        assert self.spec is not None
        return {"mode": self.spec.mode, "run": list(self.run),
                "failed": [{"check": f.check.value, "where": f.where, **({"why": log_safe(f.why)} if f.why else {})}
                           for f in self.failures[:16]],
                "rejected": self.rejected}
