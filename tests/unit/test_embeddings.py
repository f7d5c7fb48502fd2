"""The embeddings request (extproc/embeddings.py): what it takes, what it refuses naming the field, and
the upstream body written back from the messages as redaction left them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc import embeddings
from extproc.contract import ErrorCode, GatewayError


def req(**kw: Any) -> bytes:
    return json.dumps({"model": "embed-default", "input": "x", **kw}).encode()


def test_each_input_becomes_a_user_message_and_goes_back_as_input_in_order() -> None:
    body, options = embeddings.request(req(input=["a", "b c"], encoding_format="base64", user="u-1"))
    assert body == {"model": "embed-default", "messages": [{"role": "user", "content": "a"},
                                                           {"role": "user", "content": "b c"}]}
    body["messages"][1]["content"] = "[EMAIL_1]"  # as redaction leaves it
    assert embeddings.upstream_body(body, options, "served") == {
        "model": "served", "input": ["a", "[EMAIL_1]"], "encoding_format": "base64", "user": "u-1"}
    one, plain = embeddings.request(req())
    assert one["messages"] == [{"role": "user", "content": "x"}] and plain.encoding_format == "float"


def test_the_window_is_judged_on_the_longest_input() -> None:
    body, _ = embeddings.request(req(input=["short", "the longest of them", "mid one"]))
    assert embeddings.longest_input(body)["messages"] == [{"role": "user", "content": "the longest of them"}]


@pytest.mark.parametrize("raw, code, param", [
    (req(dimensions=8), ErrorCode.UNSUPPORTED_FIELD, "dimensions"),
    (req(input=[1, 2, 3]), ErrorCode.UNSUPPORTED_FIELD, "input[0]"),
    (req(input=[[1, 2]]), ErrorCode.UNSUPPORTED_FIELD, "input[0]"),
    (req(input=[]), ErrorCode.INVALID_REQUEST, "input"),
    (req(input=["ok", ""]), ErrorCode.INVALID_REQUEST, "input[1]"),
    (req(input=["x"] * 2049), ErrorCode.INVALID_REQUEST, "input"),
    (req(input={"text": "x"}), ErrorCode.INVALID_REQUEST, "input"),
    (req(encoding_format="binary"), ErrorCode.INVALID_REQUEST, "encoding_format"),
    (req(user=7), ErrorCode.INVALID_REQUEST, "user"),
    (req(model=""), ErrorCode.INVALID_REQUEST, "model"),
    (req(stream=True), ErrorCode.UNSUPPORTED_FIELD, "stream"),
    (b"[]", ErrorCode.INVALID_REQUEST, None),
    (b"{not json", ErrorCode.INVALID_REQUEST, None),
])
def test_a_refusal_names_the_field(raw: bytes, code: ErrorCode, param: str | None) -> None:
    with pytest.raises(GatewayError) as e:
        embeddings.request(raw)
    assert e.value.code is code and e.value.param == param
