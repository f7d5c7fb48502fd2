"""Every token class priced at its own rate, per provider shape, JSON and stream, through the doors its
callers use (the SDKs as their users write them): Anthropic's cache writes at the 5-minute and the
1-hour rate and its cache reads, Bedrock's cache reads and writes (a `cache_control` becomes a
`cachePoint`), Gemini's thoughts as reasoning. For each request: the provider's own count of every
class (its request log) is the ledger's, each class is a priced line at the deployment's rate for it,
the lines add up to the charge, and the usage the client sees adds up to what was charged."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import types

from extproc.settlement.charge import token_classes
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.helpers import request, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
PREAMBLE = "a long shared preamble that the provider caches for us " * 30


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("token-classes"), simulate_providers=True)
    yield s
    s.stop()


def provider_log(stack: Stack, deployment: str, marker: str) -> dict[str, Any]:
    """The provider's own record of the request (what it bills), found by the marker in its messages
    (the system prompt is not logged: a marker there also keeps each test's cache entry its own)."""
    (host, port), = stack.render.providers[deployment]
    (entry,) = [e for e in request(f"http://{host}:{port}/admin/requests").json() if marker in json.dumps(e)]
    return dict(entry)


def priced(stack: Stack, deployment: str, rid: str) -> dict[str, int]:
    """The ledger entry's classes, checked: one priced line per class at the deployment's rate, the lines
    adding up to the charge. Returned as class -> tokens."""
    entry = ledger_of(stack, rid, "acme")
    prices = stack.snapshot.deployments[deployment].prices
    lines = entry["charge_lines"]
    assert all(line["per_mtok"] == prices.per_mtok(line["class"]) for line in lines), lines
    assert entry["charged_micros"] == math.ceil(sum(line["tokens"] * line["per_mtok"] for line in lines) / 1e6)
    classes = {line["class"]: line["tokens"] for line in lines}
    assert classes == {c: n for c, n in token_classes(entry["usage"]).items() if n}
    return classes


def billed(log: dict[str, Any]) -> dict[str, int]:
    """The provider's own count, by class (0s left out)."""
    written, hour = int(log.get("cache_write_tokens") or 0), int(log.get("cache_write_1h_tokens") or 0)
    read = int(log.get("cached_tokens") or 0)
    classes = {"input": int(log["prompt_tokens"]) - read - written - hour, "cached_input": read,
               "cache_write": written, "cache_write_1h": hour, "output": int(log["output_tokens"])}
    return {c: n for c, n in classes.items() if n}


def anthropic_usage_classes(u: dict[str, Any]) -> dict[str, int]:
    """What the anthropic SDK's caller sees, by class."""
    split = u.get("cache_creation") or {}
    classes = {"input": u["input_tokens"], "cached_input": u.get("cache_read_input_tokens") or 0,
               "cache_write": split.get("ephemeral_5m_input_tokens", u.get("cache_creation_input_tokens") or 0),
               "cache_write_1h": split.get("ephemeral_1h_input_tokens", 0), "output": u["output_tokens"]}
    return {c: n for c, n in classes.items() if n}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("route", "deployment", "ttl"), [
    ("chat-anthropic", "demo-anthropic", "5m"), ("chat-anthropic", "demo-anthropic", "1h"),
    ("chat-bedrock", "demo-bedrock", "5m")])
def test_cache_writes_and_reads_through_the_anthropic_door(up: Stack, route: str, deployment: str, ttl: str,
                                                          stream: bool) -> None:
    client = anthropic.Anthropic(base_url=up.url, api_key=KEY)
    marker = unique_marker(f"classes{route}{ttl}{stream}")
    control: dict[str, Any] = {"type": "ephemeral", **({"ttl": ttl} if ttl == "1h" else {})}
    system = [{"type": "text", "text": f"{marker} {PREAMBLE}", "cache_control": control}]

    def ask(n: int) -> tuple[str, Any]:
        kw: dict[str, Any] = {"model": route, "max_tokens": 4, "system": system,
                              "messages": [{"role": "user", "content": f"turn {n} {marker}"}]}
        if stream:
            # The usage as message_delta carries it (every count, cumulative): the SDK's accumulated
            # message keeps message_start's `cache_creation`, sent before any count was known.
            with client.messages.stream(**kw) as s:
                (usage,) = [e.usage.model_dump() for e in s if e.type == "message_delta"]
                return s.response.headers["x-request-id"], usage
        raw = client.messages.with_raw_response.create(**kw)
        return raw.headers["x-request-id"], raw.parse().usage.model_dump()

    (first, seen_first), (again, seen_again) = ask(1), ask(1)
    logs = [e for host, port in up.render.providers[deployment]
            for e in request(f"http://{host}:{port}/admin/requests").json() if marker in json.dumps(e)]
    assert len(logs) == 2
    written, read = priced(up, deployment, first), priced(up, deployment, again)
    assert (written, read) == (billed(logs[0]), billed(logs[1]))  # the provider's count is the ledger's
    write_class = "cache_write_1h" if ttl == "1h" and deployment == "demo-anthropic" else "cache_write"
    assert written.get(write_class, 0) > 100 and "cached_input" not in written
    assert read.get("cached_input") == written[write_class] and write_class not in read
    if deployment == "demo-anthropic":  # what the caller sees adds up to what was charged
        assert anthropic_usage_classes(seen_first) == written and anthropic_usage_classes(seen_again) == read
    else:  # an Anthropic caller of a Bedrock candidate sees the same classes, as Anthropic names them
        assert (seen_first["cache_creation_input_tokens"], seen_again["cache_read_input_tokens"]) == (
            written["cache_write"], read["cached_input"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_cache_writes_through_the_openai_door_are_charged_and_shown(up: Stack, stream: bool) -> None:
    """An OpenAI caller marks its system part for caching (the Anthropic candidate takes the mark): the
    write is priced as a write, and the caller's usage names it beside the cache reads."""
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key=KEY)
    marker = unique_marker(f"classesopenai{stream}")
    messages: Any = [{"role": "system", "content": [{"type": "text", "text": f"{marker} {PREAMBLE}",
                                                     "cache_control": {"type": "ephemeral"}}]},
                     {"role": "user", "content": f"hello {marker}"}]
    if stream:
        with client.chat.completions.with_streaming_response.create(
                model="chat-anthropic", max_tokens=4, messages=messages, stream=True,
                stream_options={"include_usage": True}) as resp:
            rid = resp.headers["x-request-id"]
            (usage,) = [c.usage for c in resp.parse() if c.usage is not None]
    else:
        raw = client.chat.completions.with_raw_response.create(model="chat-anthropic", max_tokens=4, messages=messages)
        rid, usage = raw.headers["x-request-id"], raw.parse().usage
    classes = priced(up, "demo-anthropic", rid)
    assert classes == billed(provider_log(up, "demo-anthropic", marker))
    assert usage is not None and usage.prompt_tokens_details is not None
    shown = usage.prompt_tokens_details.model_dump()
    assert shown.get("cache_write_tokens") == classes["cache_write"] > 100
    assert usage.prompt_tokens == sum(n for c, n in classes.items() if c not in ("output", "reasoning"))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_gemini_thoughts_are_reasoning_priced_as_the_deployment_says(up: Stack, stream: bool) -> None:
    client = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=up.url))
    config = types.GenerateContentConfig(max_output_tokens=200, thinking_config=types.ThinkingConfig(
        include_thoughts=True, thinking_budget=64))
    marker = unique_marker(f"classesgemini{stream}")
    if stream:
        pieces = list(client.models.generate_content_stream(model="chat-gemini", contents=marker, config=config))
        usage, rid = pieces[-1].usage_metadata, pieces[-1].sdk_http_response
    else:
        r = client.models.generate_content(model="chat-gemini", contents=marker, config=config)
        usage, rid = r.usage_metadata, r.sdk_http_response
    assert usage is not None and rid is not None and rid.headers is not None
    classes = priced(up, "demo-gemini", rid.headers["x-request-id"])
    assert classes["reasoning"] == usage.thoughts_token_count and classes["reasoning"] > 0
    assert classes["output"] == usage.candidates_token_count  # the answer's tokens, apart from the thoughts
    assert sum(classes.values()) == usage.total_token_count  # what the caller sees adds up to what was charged
