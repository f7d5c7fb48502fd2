"""Reading Envoy's messages to ext_proc: CEL attributes and metadata Structs, header maps, and a
stream whose first message was already read. Shared by every ext_proc handler."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.names import metadata_path


async def with_first(first: ep.ProcessingRequest,
                     rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingRequest]:
    """The messages of one ext_proc stream whose first message was read to choose its handler."""
    yield first
    async for m in rest:
        yield m


def attr(attrs: Any, key: str) -> str:
    """A string (or whole number, as text) from a Struct: ext_proc's CEL attributes or Envoy's metadata."""
    v = attrs.fields.get(key) if attrs is not None else None
    if v is None:
        return ""
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return str(v.string_value)
    if kind == "number_value":  # (an upstream's usage may hold any JSON number: inf has no whole number)
        return str(int(v.number_value)) if math.isfinite(v.number_value) else ""
    return ""


def count_attr(attrs: Any, key: str) -> Any:
    """A usage count from Envoy's metadata as the upstream wrote it (json_to_metadata keeps the JSON
    type; the Lua stream guard a whole number as a number, anything else as its text): a whole number
    as an int, None when absent or null, anything else as itself - a fraction, inf, a string, a
    boolean - for accounting.believable() to refuse rather than round into a count."""
    v = attrs.fields.get(key) if attrs is not None else None
    if v is None:
        return None
    kind = v.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "number_value":
        n = v.number_value
        return int(n) if math.isfinite(n) and n == int(n) else n
    if kind in ("string_value", "bool_value"):
        return getattr(v, kind)
    return kind  # an object or a list: no count


def md_attr(attrs: Any, key: str) -> str:
    """An io.llmgw metadata value Envoy sent as a CEL attribute (`{MD}['key']`)."""
    return attr(attrs, metadata_path(key))


def header_text(h: Any) -> str:
    """A HeaderValue of an ext_proc headers message: its raw bytes as UTF-8 when Envoy sent them so."""
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)


def header(headers: Any, key: str, default: str = "") -> str:
    """One header's value from an ext_proc HeaderMap."""
    return next((header_text(h) for h in headers.headers if h.key == key), default)
