"""The fields current OpenAI clients send that the gateway answers itself (extproc/client_fields.py),
as a table: each value in, what the request keeps and what it refuses."""

from __future__ import annotations

from typing import Any

import pytest

from extproc import chat
from extproc.client_fields import OWNED, REFUSED, take
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.registry import loss_table


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "chat-default", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("sent, kept, metadata", [
    ({"store": False}, {}, {}),
    ({"service_tier": "auto"}, {}, {}),
    ({"service_tier": "default"}, {}, {}),
    ({"modalities": ["text"]}, {}, {}),
    ({"prompt_cache_key": "tenant-cache-7"}, {}, {}),
    ({"metadata": {"team": "search", "job": "nightly"}}, {}, {"team": "search", "job": "nightly"}),
    ({"safety_identifier": "u-9"}, {"user": "u-9"}, {}),
    ({"safety_identifier": "u-9", "user": "u-9"}, {"user": "u-9"}, {}),
    ({"store": None, "prediction": None}, {}, {}),  # null asks for nothing
])
def test_what_the_gateway_answers_itself_leaves_the_request(sent: dict[str, Any], kept: dict[str, Any],
                                                            metadata: dict[str, str]) -> None:
    b = body(**sent)
    got = take(b)
    assert b == body(**kept) and got.metadata == metadata
    chat.validate(b, 64, 4)  # what is left is the contract


@pytest.mark.parametrize("sent, code, param", [
    ({"store": True}, ErrorCode.UNSUPPORTED_FIELD, "store"),
    ({"store": "yes"}, ErrorCode.INVALID_REQUEST, "store"),
    ({"service_tier": "priority"}, ErrorCode.UNSUPPORTED_FIELD, "service_tier"),
    ({"service_tier": "flex"}, ErrorCode.UNSUPPORTED_FIELD, "service_tier"),
    ({"modalities": ["text", "audio"]}, ErrorCode.UNSUPPORTED_FIELD, "modalities"),
    ({"metadata": {"k": 1}}, ErrorCode.INVALID_REQUEST, "metadata.k"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, ErrorCode.INVALID_REQUEST, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, ErrorCode.INVALID_REQUEST, "metadata." + "k" * 65),
    ({"safety_identifier": "a", "user": "b"}, ErrorCode.INVALID_REQUEST, "safety_identifier"),
    ({"prediction": {"type": "content", "content": "x"}}, ErrorCode.UNSUPPORTED_FIELD, "prediction"),
    ({"web_search_options": {}}, ErrorCode.UNSUPPORTED_FIELD, "web_search_options"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, ErrorCode.UNSUPPORTED_FIELD, "audio"),
])
def test_what_no_route_takes_is_refused_naming_it(sent: dict[str, Any], code: ErrorCode, param: str) -> None:
    with pytest.raises(GatewayError) as e:
        take(body(**sent))
    assert e.value.code is code and e.value.param == param


def test_owned_and_refused_fields_are_not_the_contracts() -> None:
    """A field is decided in one place: the gateway's own, refused, or the contract's (adapters)."""
    assert not set(OWNED) & set(REFUSED)
    assert not (set(OWNED) | set(REFUSED)) & set(chat.CONTRACT_FIELDS)


@pytest.mark.parametrize("field, value, honoured_by", [
    ("reasoning_effort", "low", {"openai@1 vllm", "openai@1 openai"}),
    ("verbosity", "low", {"openai@1 openai"}),
])
def test_model_fields_reach_the_candidates_that_honour_them(field: str, value: str, honoured_by: set[str]) -> None:
    chat.validate(body(**{field: value}), 64, 4)
    for ref, kind in (("openai@1", "vllm"), ("openai@1", "openai"), ("anthropic@1", ""), ("gemini@1", ""),
                      ("bedrock@1", "")):
        rule = loss_table(ref, {"kind": kind} if kind else {}).get(field)
        honoured = rule == "supported"
        assert honoured == (f"{ref} {kind}" in honoured_by), (ref, kind, rule)


def test_the_fields_table_names_every_decided_field() -> None:
    """docs/FIELDS.md is what users read: every owned and refused field is in it."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs/FIELDS.md").read_text()
    for name in (*OWNED, *REFUSED, "reasoning_effort", "verbosity"):
        assert f"| `{name}`" in text, name
