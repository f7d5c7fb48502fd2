"""The Anthropic-shaped provider (enginesim --api anthropic) and the `anthropic` adapter over real HTTP
(issue 13): the real `anthropic` SDK accepts what the simulated provider answers (so the simulator
speaks the shape), and the adapter's translation of a contract request is served by it and
translated back - JSON, streams, the provider's errors and faults."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from extproc.chat import validate
from extproc.contract import ErrorCode
from extproc.shapes.base import Target
from tests.conftest import module_provider
from tests.helpers import request
from tests.oracles.anthropic import ANTHROPIC
from tests.oracles.base import UpstreamBroken

MODEL = "claude-sim-1"
KEY = "sk-ant-test-0123456789"


provider = module_provider("anthropic", MODEL, KEY, "--max-model-len", "4096", "--fault-header")


def client(url: str, key: str = KEY, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, default_headers=headers or None)


def test_the_sdk_reads_a_message(provider: str) -> None:
    msg = client(provider).messages.create(model=MODEL, max_tokens=6, system="be brief",
                                           messages=[{"role": "user", "content": "hello"}])
    assert msg.type == "message" and msg.model == MODEL and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert 0 < msg.usage.output_tokens <= 6 and msg.usage.input_tokens > 0


def test_the_sdk_reads_a_stream_and_its_usage(provider: str) -> None:
    with client(provider).messages.stream(model=MODEL, max_tokens=5,
                                          messages=[{"role": "user", "content": "stream please"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.usage.output_tokens == 5
    assert final.stop_reason == "max_tokens"


def test_a_prompt_marked_for_caching_is_written_then_read(provider: str) -> None:
    """As the provider bills its cache: the first request writes the prompt through the breakpoint
    (`cache_creation_input_tokens`, split by TTL), a repeat within the TTL reads it; every prompt token
    is in one of input, written and read."""
    text = {"type": "text", "text": "a long shared preamble " * 40}
    marked = [{"role": "user", "content": [{**text, "cache_control": {"type": "ephemeral"}}]}]
    first = client(provider).messages.create(model=MODEL, max_tokens=2, messages=marked)
    again = client(provider).messages.create(model=MODEL, max_tokens=2, messages=marked)
    written = first.usage.cache_creation_input_tokens or 0
    assert first.usage.cache_read_input_tokens == 0 and written > 100
    assert first.usage.cache_creation is not None and first.usage.cache_creation.ephemeral_5m_input_tokens == written
    assert again.usage.cache_read_input_tokens == written and again.usage.cache_creation_input_tokens == 0

    def prompt(u: Any) -> int:
        return int(u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0))
    assert prompt(again.usage) == prompt(first.usage)
    hour = [{"role": "user", "content": [{"type": "text", "text": "another preamble " * 40,
                                          "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]
    long_lived = client(provider).messages.create(model=MODEL, max_tokens=2, messages=hour).usage
    assert long_lived.cache_creation is not None and long_lived.cache_creation.ephemeral_1h_input_tokens
    assert long_lived.cache_creation.ephemeral_1h_input_tokens == long_lived.cache_creation_input_tokens
    # Unmarked, the provider caches nothing (it was not asked to).
    plain = client(provider).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [text]}])
    assert plain.usage.cache_read_input_tokens == 0 and plain.usage.cache_creation_input_tokens == 0


def test_more_than_four_breakpoints_are_refused(provider: str) -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError):
        client(provider).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [block] * 5}])


@pytest.mark.parametrize(("kwargs", "error", "status"), [
    ({"key": "sk-wrong"}, anthropic.AuthenticationError, 401),
    ({"model": "no-such-model"}, anthropic.NotFoundError, 404),
    ({"fault": "status=529"}, anthropic.APIStatusError, 529),
    ({"fault": "status=429"}, anthropic.RateLimitError, 429),
])
def test_the_providers_errors_are_its_own(provider: str, kwargs: dict[str, Any], error: type[Exception],
                                          status: int) -> None:
    headers = {"x-enginesim-fault": kwargs["fault"]} if "fault" in kwargs else {}
    with pytest.raises(error) as e:
        client(provider, kwargs.get("key", KEY), **headers).messages.create(
            model=kwargs.get("model", MODEL), max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert getattr(e.value, "status_code", None) == status


def test_the_provider_requires_what_the_api_requires(provider: str) -> None:
    url = f"{provider}/v1/messages"
    base = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    no_max = request(url, "POST", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, base)
    assert no_max.status == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
    no_version = request(url, "POST", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
                         {"x-api-key": KEY})
    assert no_version.status == 400
    logged = request(f"{provider}/admin/requests").json()
    assert all("x-api-key" not in e["headers"] for e in logged) and all(KEY not in json.dumps(e) for e in logged)


# -- the adapter against the provider ------------------------------------------------------------

def contract(**extra: Any) -> dict[str, Any]:
    return validate({"model": "chat-anthropic", "messages": [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hello there"}],
                     "max_tokens": 7, **extra}, 64, 8)


def send(provider: str, body: dict[str, Any], fault: str = "") -> Any:
    native = ANTHROPIC.request(body, Target(MODEL, KEY))
    headers = {**native.headers, **({"x-enginesim-fault": fault} if fault else {})}
    return request(provider + native.path, "POST", native.body, headers)


def test_the_adapter_is_served_and_translated_back(provider: str) -> None:
    r = send(provider, contract())
    assert r.status == 200, r.body
    doc = ANTHROPIC.response(r.status, r.body)
    assert doc["object"] == "chat.completion" and doc["choices"][0]["message"]["content"]
    assert doc["choices"][0]["finish_reason"] in ("stop", "length")
    assert doc["usage"]["completion_tokens"] <= 7 and doc["usage"]["prompt_tokens"] > 0


def test_the_adapters_stream_is_served_and_translated_back(provider: str) -> None:
    r = send(provider, contract(stream=True))
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    t = ANTHROPIC.stream()
    out = t.feed(r.body) + t.finish()
    chunks = [e[6:] for e in b"".join(out).decode().split("\n\n") if e]
    assert chunks[-1] == "[DONE]"
    docs = [json.loads(c) for c in chunks[:-1]]
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in docs if d["choices"])
    assert text and docs[-1]["usage"]["completion_tokens"] == 7
    assert [d["choices"][0]["finish_reason"] for d in docs if d["choices"]][-1] == "length"


@pytest.mark.parametrize(("fault", "code", "retry"), [("status=529", ErrorCode.UPSTREAM_ERROR, "overloaded"),
                                                      ("status=429", ErrorCode.UPSTREAM_ERROR, "rate_limited"),
                                                      ("status=500", ErrorCode.UPSTREAM_ERROR, "unavailable")])
def test_the_providers_errors_map_to_the_contract(provider: str, fault: str, code: ErrorCode, retry: str) -> None:
    r = send(provider, contract(), fault)
    f = ANTHROPIC.failure(r.status, r.body)
    assert (f.code, f.retry) == (code, retry)


@pytest.mark.parametrize("fault", ["error_after=2", "malformed_after=2"])
def test_a_broken_provider_stream_is_broken_for_the_gateway(provider: str, fault: str) -> None:
    r = send(provider, contract(stream=True), fault)
    t = ANTHROPIC.stream()
    with pytest.raises(UpstreamBroken):
        t.feed(r.body)
        t.finish()
