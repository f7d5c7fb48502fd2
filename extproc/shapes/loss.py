"""Translation loss: what an adapter does with each field of the gateway's request contract (the chat
completion request of extproc/chat.py), declared as data, and the loss list of one request.

  supported    carried as it is (or renamed, with the same meaning)
  transformed  carried with a different shape whose meaning is the same for the values allowed
  emulated     not sent; the gateway produces the effect itself
  unsupported  cannot be carried: the field's loss rule decides (reject: 400
               `unsupported_field` naming it; report: served, the field listed in
               `x-llmgw-translation-loss` and the ledger)

The loss rule is per field. A contract (`response_format`, `tool_choice`, `n`, `logprobs`, ...) is
something the caller relies on: the route's `translation_loss` rules it (reject by default). A hint
(HINT_FIELDS: the end user's id, how hard to think, how long to write) changes how an answer is made,
never what the caller may rely on, and agents send them on every request: dropped and reported
whatever the route's rule. A route may set any field's rule (`translation_loss_fields`).

A field can also be lost for some values only (a temperature above the provider's range, `n` above
1): a `Conditional` names the condition. A field absent from the request, or present with its
default, is never a loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Support(StrEnum):
    SUPPORTED = "supported"
    TRANSFORMED = "transformed"
    EMULATED = "emulated"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Conditional:
    """`otherwise` for most values; `lost(value)` says when this value is carried as `loss` instead
    (`when` says it in words)."""

    lost: Callable[[Any], bool]
    when: str
    otherwise: Support = Support.SUPPORTED
    loss: Support = Support.UNSUPPORTED


Rule = Support | Conditional
LossTable = Mapping[str, Rule]  # top-level request field -> what the adapter does with it


# The request fields that are hints (see the module's docstring); a door's own hints are its Door.hints.
HINT_FIELDS = frozenset({"user", "reasoning_effort", "verbosity"})


@dataclass(frozen=True)
class Loss:
    field: str
    support: Support  # TRANSFORMED, EMULATED or UNSUPPORTED
    note: str = ""

    def __str__(self) -> str:
        return f"{self.field} ({self.support})"


# Values that mean "not asked for": a field sent with one of these is no loss.
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "n": (1,), "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "parallel_tool_calls": (True,), "stream": (False,),
    "logit_bias": ({},), "stop": ([],), "tools": ([],),
}
# A front door's provider-only fields (Gemini's safetySettings, Anthropic's service_tier), carried in
# the internal body for a plan whose every candidate speaks the door's shape, whose adapter sends
# them as they came (extproc/shapes/door.py). Only a door sets it, after its request was checked. A
# field inside an object is named by its dotted path (`generationConfig.thinkingConfig`).
NATIVE = "llmgw_native"
# Where the Responses door leaves the namespaces of its tools for intake (extproc/exchange.py Key.NAMESPACES).
NAMESPACES = "llmgw_namespaces"
# Fields every adapter handles because the gateway itself owns them (never sent by the client as such).
GATEWAY_FIELDS = frozenset({"model", "messages", NATIVE})


def with_native(native: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """A provider request with the door's own fields (NATIVE) set as its caller sent them, a dotted
    one inside the object the adapter wrote (thinkingConfig beside maxOutputTokens)."""
    for path, value in (body.get(NATIVE) or {}).items():
        *outer, key = path.split(".")
        into = native
        for name in outer:
            into = into.setdefault(name, {})
        into[key] = value
    return native


# A prompt-caching breakpoint on a message part or a tool (extproc/chat.py `_cache_control`): not a
# top-level field, so each loss table names it on its own, and a request carrying one is judged as if
# it were one.
CACHE_CONTROL = "cache_control"


def content_hint(content: Any) -> dict[str, Any] | None:
    """The caching breakpoint a message's content (a list of parts or blocks) carries: its first
    part's; None for text, or parts without one."""
    if not isinstance(content, list):
        return None
    return next((p[CACHE_CONTROL] for p in content if isinstance(p, dict) and p.get(CACHE_CONTROL)), None)


def cache_hinted(body: Mapping[str, Any]) -> bool:
    """Whether any part of any message, or any tool, carries a caching breakpoint."""
    if any(isinstance(t, dict) and t.get(CACHE_CONTROL) for t in body.get("tools") or ()):
        return True
    return any(content_hint(m.get("content")) for m in body.get("messages") or () if isinstance(m, dict))


def without_cache_hints(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request with its caching breakpoints removed, for an upstream that caches on its own."""
    out = dict(body)
    out["messages"] = [{**m, "content": [{k: v for k, v in p.items() if k != CACHE_CONTROL} for p in m["content"]]}
                       if isinstance(m.get("content"), list) else m for m in body["messages"]]
    if body.get("tools"):
        out["tools"] = [{k: v for k, v in t.items() if k != CACHE_CONTROL} for t in body["tools"]]
    return out


def losses(body: Mapping[str, Any], table: LossTable) -> list[Loss]:
    """What translating this request with this table loses or changes; fields the table does not
    name are unsupported (a new contract field is a loss until an adapter says otherwise)."""
    out: list[Loss] = []
    fields: Iterable[tuple[str, Any]] = body.items()
    if cache_hinted(body):
        fields = [*fields, (CACHE_CONTROL, True)]
    for name, value in fields:
        if name in GATEWAY_FIELDS or value is None or value in DEFAULTS.get(name, ()):
            continue
        rule = table.get(name, Support.UNSUPPORTED)
        if isinstance(rule, Conditional):
            if rule.lost(value):
                out.append(Loss(name, rule.loss, rule.when))
            elif rule.otherwise is not Support.SUPPORTED:
                out.append(Loss(name, rule.otherwise))
        elif rule is not Support.SUPPORTED:
            out.append(Loss(name, rule))
    return out


def describe(rule: Rule) -> str:
    if isinstance(rule, Conditional):
        return f"{rule.otherwise}; {rule.loss} {rule.when}"
    return str(rule)
