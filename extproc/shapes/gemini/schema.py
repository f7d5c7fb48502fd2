"""Gemini's `Schema` (an OpenAPI 3.0 subset: `"type": "OBJECT"`, `nullable`) as the JSON Schema the
internal contract carries.

The Gemini API takes a function's parameters and a JSON answer's shape either as JSON Schema
(`parametersJsonSchema`, `responseJsonSchema`) or as its own `Schema` (`parameters`, `responseSchema`).
The google-genai SDK sends the second for a Python function (automatic function calling), for
`types.Schema(...)` and for a pydantic class, so the door takes both and converts the second here,
field by field: every `Schema` field has a JSON Schema keyword of the same meaning except
`propertyOrdering` (the order of `properties` already says it) and `example` (JSON Schema's
`examples`). A field `Schema` does not have is refused like any other the door does not know.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Type = Literal["TYPE_UNSPECIFIED", "STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"]


class Schema(BaseModel):
    # Field names as lowerCamelCase or the proto's snake_case: the SDK sends `property_ordering`.
    # int64 fields (`maxItems`, ...) arrive as numbers or, as proto3 JSON writes int64, as strings.
    model_config = ConfigDict(extra="forbid", strict=False, populate_by_name=True, alias_generator=to_camel)

    type: Type | None = None
    format: str | None = None
    title: str | None = None
    description: str | None = None
    nullable: bool | None = None
    enum: list[str] | None = None
    items: Schema | None = None
    properties: dict[str, Schema] | None = None
    required: list[str] | None = None
    property_ordering: list[str] | None = None
    any_of: list[Schema] | None = None
    default: Any = None
    example: Any = None
    pattern: str | None = None
    min_items: int | None = Field(default=None, ge=0)
    max_items: int | None = Field(default=None, ge=0)
    min_length: int | None = Field(default=None, ge=0)
    max_length: int | None = Field(default=None, ge=0)
    min_properties: int | None = Field(default=None, ge=0)
    max_properties: int | None = Field(default=None, ge=0)
    minimum: float | None = None
    maximum: float | None = None


# Schema field -> the JSON Schema keyword with the same meaning (the rest: below).
_SAME = {"format": "format", "title": "title", "description": "description", "enum": "enum", "default": "default",
         "pattern": "pattern", "required": "required", "min_items": "minItems", "max_items": "maxItems",
         "min_length": "minLength", "max_length": "maxLength", "min_properties": "minProperties",
         "max_properties": "maxProperties", "minimum": "minimum", "maximum": "maximum"}


def either(openapi: Schema | None, given: dict[str, Any] | None, names: str) -> dict[str, Any] | None:
    """The JSON Schema of a field Gemini takes in either spelling (`names`: the two, for the error):
    the one given, the OpenAPI one converted; ValueError for both."""
    if openapi is not None and given is not None:
        raise ValueError(f"takes {names}, not both")
    return json_schema(openapi) if openapi is not None else given


def json_schema(s: Schema) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12 keywords) that accepts what `s` accepts."""
    out: dict[str, Any] = {}
    if s.type is not None and s.type != "TYPE_UNSPECIFIED":
        kind = s.type.lower()
        out["type"] = [kind, "null"] if s.nullable and kind != "null" else kind
    for field, keyword in _SAME.items():
        value = getattr(s, field)
        if value is not None:
            out[keyword] = int(value) if keyword in ("minimum", "maximum") and float(value).is_integer() \
                and s.type == "INTEGER" else value
    if s.example is not None:
        out["examples"] = [s.example]
    if s.items is not None:
        out["items"] = json_schema(s.items)
    if s.properties is not None:
        out["properties"] = {name: json_schema(sub) for name, sub in s.properties.items()}
    if s.any_of is not None:
        out["anyOf"] = [json_schema(sub) for sub in s.any_of]
        if s.nullable:
            out["anyOf"].append({"type": "null"})
    if s.nullable and "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out
