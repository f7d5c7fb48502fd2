"""The shapes registry: every provider API shape the gateway speaks, and what it has of each.

A shape's adapter translates towards its upstreams (extproc/shapes/), its door - where it has one -
translates for clients who speak it (extproc/shapes/*/door.py), Envoy's Lua filters translate its answers on
the paths that keep ext_proc out of the answer (extproc/lua/answers.lua, doors.lua: their tables are
rendered in from here), and the simulator stands in for its providers (`enginesim --api`). Every list
of shapes the gateway keeps derives from SHAPES: the adapters by name, the doors and their credential
headers, the headers an attempt removes, the Lua dispatch, the loss table's columns, the simulator's
front end for a hosted deployment (tests/unit/test_shapes.py checks the simulator's own table against
it: the simulator imports nothing of the gateway).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from extproc.contract import CHAT_PATH, EMBEDDINGS_PATH, MODELS_PATH
from extproc.shapes.anthropic import adapter as anthropic
from extproc.shapes.anthropic import door as anthropic_door
from extproc.shapes.base import Adapter
from extproc.shapes.bedrock import adapter as bedrock
from extproc.shapes.door import Door, path_of
from extproc.shapes.gemini import adapter as gemini
from extproc.shapes.gemini import door as gemini_door
from extproc.shapes.loss import LossTable
from extproc.shapes.openai import adapter as openai
from extproc.shapes.openai import door as openai_door


@dataclass(frozen=True)
class Shape:
    name: str  # as a deployment's fingerprint names its adapter (`anthropic@1`)
    adapter: Adapter
    loss_columns: Mapping[str, LossTable]  # its columns in `llmgw adapters loss-table`, by heading
    # Headers its adapter may set on a request (keys, protocol versions, signatures): an attempt to a
    # candidate that did not set them removes them (Envoy reuses an earlier attempt's headers).
    request_headers: tuple[str, ...]
    options: frozenset[str] = frozenset()  # the adapter options a deployment may set
    door: Door | None = None  # its front door, where clients may speak it to the gateway
    # Envoy's Lua answer filter translates its JSON answers, and its streams (openai's pass as they come).
    lua_answers: bool = False
    lua_streams: bool = False
    answer_tables: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # the answer filter's CONFIG entries
    door_tables: Mapping[str, Mapping[Any, Any]] = field(default_factory=dict)  # the door filter's CONFIG.<name>
    count_field: str = ""  # the field of its count answer that holds the prompt's tokens
    # The simulator's front end for a hosted deployment of this shape, by its adapter option `kind`.
    simulator_apis: Mapping[str, str] = field(default_factory=dict)

    def simulator_api(self, options: Mapping[str, str]) -> str:
        return self.simulator_apis.get(options.get("kind", ""), self.name)


SHAPES: tuple[Shape, ...] = (
    Shape("openai", openai.OPENAI, {"openai (vLLM pool)": openai.TABLES["vllm"],
                                    "openai (OpenAI, Azure)": openai.TABLES["openai"]},
          ("api-key",), frozenset({"kind", "deployment", "api_version"}), door=openai_door.DOOR, lua_answers=True,
          count_field="count",
          door_tables={"error_types": openai_door.ERROR_TYPES, "incomplete": openai_door.INCOMPLETE},
          simulator_apis={"azure": "azure"}),
    Shape("anthropic", anthropic.ANTHROPIC, {"anthropic": anthropic.LOSS_TABLE}, ("x-api-key", "anthropic-version"),
          door=anthropic_door.DOOR, lua_answers=True, lua_streams=True, count_field="input_tokens",
          answer_tables={"anthropic_stop": anthropic.STOP_REASONS},
          door_tables={"error_types": anthropic_door.ERROR_TYPES, "stop_reasons": anthropic_door.STOP_REASONS}),
    Shape("gemini", gemini.GEMINI, {"gemini": gemini.LOSS_TABLE}, ("x-goog-api-key",),
          door=gemini_door.DOOR, lua_answers=True, lua_streams=True, count_field="totalTokens",
          answer_tables={"gemini_finish": gemini.FINISH_REASONS},
          door_tables={"statuses": gemini_door.STATUSES, "finish": gemini_door.FINISH}),
    Shape("bedrock", bedrock.BEDROCK, {"bedrock": bedrock.LOSS_TABLE},
          ("x-amz-date", "x-amz-security-token", "x-amz-content-sha256"),
          frozenset({"region", "host"}), lua_answers=True, lua_streams=True, count_field="inputTokens",
          answer_tables={"bedrock_stop": bedrock.STOP_REASONS, "bedrock_output": {"tool": bedrock.OUTPUT_TOOL}}),
)
BY_NAME: Mapping[str, Shape] = MappingProxyType({s.name: s for s in SHAPES})
ALIASES = MappingProxyType({"openai-compat": "openai"})  # the name deployments used before adapters had modules
ADAPTERS: Mapping[str, Adapter] = MappingProxyType({s.name: s.adapter for s in SHAPES})
DOORS: tuple[Door, ...] = tuple(s.door for s in SHAPES if s.door is not None)
DOORS_BY_NAME: Mapping[str, Door] = MappingProxyType({d.name: d for d in DOORS})
CREDENTIAL_HEADERS = tuple(h for d in DOORS for h in d.credential_headers)  # never forwarded
CREDENTIAL_QUERY = tuple(d.credential_query for d in DOORS if d.credential_query)  # never forwarded or logged
REQUEST_HEADERS = tuple(h for s in SHAPES for h in s.request_headers)


def shape_of(ref: str) -> Shape:
    """The shape a fingerprint's adapter reference names (`anthropic@1`); KeyError for one this
    gateway does not have, or for another version of it."""
    name, _, version = ref.partition("@")
    shape = BY_NAME[ALIASES.get(name, name)]
    if version and version != str(shape.adapter.version):
        raise KeyError(f"{ref}: this gateway's {shape.name} adapter is version {shape.adapter.version}")
    return shape


@functools.cache
def code_digest(ref: str) -> str:
    """The digest of the code of the shape `ref` names (every file of extproc/shapes/<shape>/: its
    adapter, its answers' and its door's translations). Evidence records carry it: a record earned by
    other code qualifies nothing (extproc/config/evidence.py). Read once per process: the code a
    worker runs does not change under it."""
    folder = Path(__file__).parent / shape_of(ref).name
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".lua") and p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def adapter_for(ref: str) -> Adapter:
    return shape_of(ref).adapter


def loss_table(ref: str, options: Mapping[str, str]) -> LossTable:
    """What the adapter `ref`, with a deployment's adapter options, does with each field."""
    adapter = adapter_for(ref)
    return openai.TABLES[options.get("kind", "vllm")] if adapter is openai.OPENAI else adapter.loss_table


def check_options(ref: str, options: Mapping[str, str]) -> str:
    """What is wrong with a deployment's adapter options ("" when nothing)."""
    shape = shape_of(ref)
    unknown = sorted(set(options) - shape.options)
    if unknown:
        return f"the {shape.name} adapter takes no option {', '.join(unknown)}"
    if shape.adapter is openai.OPENAI and options.get("kind", "vllm") not in openai.TABLES:
        return f"kind must be one of {', '.join(openai.TABLES)}"
    if shape.adapter is bedrock.BEDROCK and not options.get("region"):
        return "the bedrock adapter needs the option region (the SigV4 signature names it)"
    return ""


def models_door(path: str, headers: Mapping[str, str]) -> Door | None:
    """The door whose shape a model lookup (GET) is answered in: one with a models path of its own,
    or the one whose SDK's header the request carries; None: OpenAI's shape."""
    bare = path_of(path)
    for door in DOORS:
        if door.models_path and re.fullmatch(door.models_path, bare):
            return door
    return next((d for d in DOORS if d.models_header and d.models_header in headers), None)


# Every endpoint the gateway serves, as a caller writes it: the chat completions API's, then each door's.
ENDPOINTS = (f"POST {CHAT_PATH}", f"POST {EMBEDDINGS_PATH}", f"GET {MODELS_PATH}",
             *(e for door in DOORS for e in door.endpoints))


def door_for(path: str) -> Door | None:
    """The door a request path opens (the query string aside); None: the chat completions API."""
    return next((d for d in DOORS if d.matches(path)), None)
