"""Front doors: the API shapes a client may speak to the gateway besides OpenAI's chat completions.

A door turns its request into the internal contract (extproc/chat.py's chat completion request) at
intake, so identity, authorization, budgets, redaction, routing, fallback and metering run once, on
one shape; its answers, streams and errors are turned back into the caller's shape at the edge, by
the Lua door filter (extproc/lua/doors.lua), after metering has read the internal shape. Adapters
(extproc/shapes/) are the same translation in the other direction, towards upstreams. Plain values
in and out, no Envoy types. The doors, and the credential headers they take, are listed by the shapes
registry (extproc/shapes/registry.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from extproc.contract import ErrorCode, GatewayError


def null_is_absent(data: Any) -> Any:
    """A request object without its null fields: a field sent as null asks for nothing. The SDKs'
    model_dump() of what they returned carries every optional field they know (anthropic's
    `"caller": null` on a tool_use block), and clients replay those as the next turn's history. (A
    door model's `mode="before"` validator: a field the door does not carry is refused only when it
    holds a value.)"""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StrictModel(BaseModel):
    """A door's request model: strict about types, a field it does not know refused (by name, at the
    door), a field sent as null absent."""
    model_config = ConfigDict(extra="forbid", strict=True)

    _null_is_absent = model_validator(mode="before")(null_is_absent)


def validation_param(loc: tuple[Any, ...]) -> str:
    """pydantic's location of an error as the field path a client recognises (`messages.0.content`),
    without the union members' and validators' tags."""
    def tag(p: Any) -> bool:
        return isinstance(p, str) and (p[:1].isupper() or p.startswith(("list[", "str", "function-", "literal")))
    return ".".join(str(p) for p in loc if not tag(p))


def validated(model: type[StrictModel], doc: Any, api: str, at: tuple[Any, ...] = ()) -> Any:
    """`doc` as the door's `model` (`at`: where it stands in the request); else the contract's 400 naming
    the field. A field the gateway does not carry is named first: it is why the rest does not fit either."""
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        err = next((x for x in e.errors() if x["type"] == "extra_forbidden"), e.errors()[0])
        param = validation_param((*at, *err["loc"]))
        if err["type"] == "extra_forbidden":
            raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{param}` is not carried by this gateway's {api}",
                               param) from None
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{param}: {err['msg']}", param or None) from None


def path_of(target: str) -> str:
    """A request's path without its query, as Envoy matched its routes on it. Not urllib's urlsplit:
    a path that starts with `//` would be read as a host and the rest (a client chooses both), and
    one with `//[` raises."""
    return target.split("?", 1)[0]


def query_of(target: str) -> str:
    return target.partition("?")[2]


@dataclass(frozen=True)
class Door:
    name: str
    path: str  # a regular expression the whole path (without its query) matches; Envoy's routes use it too
    request: Callable[[bytes, str], dict[str, Any]]  # the raw body and path -> the internal request (GatewayError)
    error: Callable[[int, bytes], bytes]  # a contract error body -> the caller's (Envoy's own, rendered in)
    credential_headers: tuple[str, ...] = ()  # where its SDK puts the key, besides Authorization: Bearer
    credential_query: str = ""  # a query parameter that may carry the key (Gemini's `key`)
    # An internal request field -> where the door's caller wrote it: a refusal names the field the
    # caller sent (`metadata.user_id`, not the internal `user`).
    fields: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Model lookups in the door's shape (its SDK's models.get / models.list): a route as the door's
    # model object (route, input and output token limits), the list around them; asked for on a path
    # of the door's own (`models_path`, a regular expression whose group 1 is the route, if any) or on
    # the shared GET /v1/models by a request carrying `models_header` (what the door's SDK always sends).
    model_object: Callable[[str, int, int], dict[str, Any]] | None = None
    model_list: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
    models_path: str = ""
    models_header: str = ""
    # Token counting (Anthropic's count_tokens, Gemini's countTokens): the path it is asked on (a
    # regular expression, as `path`) and its request as the internal contract.
    count_path: str = ""
    count_request: Callable[[bytes, str], dict[str, Any]] | None = None
    # Of the door's own fields (NATIVE), the hints: how hard to think, whether to show the thinking,
    # how to manage the context. A candidate of another shape is served without them and they are
    # reported as lost, whatever the route's loss rule (extproc/stages/route.py native_plan): a hint
    # changes how an answer is made, never what the caller may rely on, and every agent sends them.
    # A name stands for itself and for what it holds (`tools`: each of `tools.N`).
    hints: frozenset[str] = frozenset()
    # What the door serves, as its callers write it ("POST /v1/messages"): a request on a path the
    # gateway does not serve is answered with every door's list.
    endpoints: tuple[str, ...] = ()

    def is_hint(self, name: str) -> bool:
        return name in self.hints or name.split(".", 1)[0] in self.hints

    def field_name(self, internal: str) -> str:
        return self.fields.get(internal, internal)

    def matches(self, path: str) -> bool:
        bare = path_of(path)  # (once: every request's path is tried against every door)
        return any(re.fullmatch(p, bare) is not None for p in self.paths)

    @property
    def paths(self) -> tuple[str, ...]:
        """The regular expressions of every path the door takes a request on (one each: Envoy bounds
        the size of one expression's program)."""
        return (self.path, self.count_path) if self.count_path else (self.path,)

    def counts(self, path: str) -> bool:
        """Whether `path` asks this door for a token count."""
        return bool(self.count_path) and re.fullmatch(self.count_path, path_of(path)) is not None
