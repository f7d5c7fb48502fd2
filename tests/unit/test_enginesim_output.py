"""What the simulated model writes (enginesim/output.py), through its HTTP API with the openai SDK as
the client: tool calls (auto, required, named, parallel, streamed as deltas), JSON output that parses
and matches its schema, stop strings, logprobs, `n` choices, and vLLM's 400s for what it refuses."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enginesim.output import from_schema, plan
from llmgw.local.procs import Child, free_port, http_ok, python_module, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}}
SCHEMA = {"type": "object", "required": ["title", "tags", "score", "ok"], "properties": {
    "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "score": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"},
    "nested": {"type": "object", "properties": {"n": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    port = free_port()
    log = Path(tmp_path_factory.mktemp("engine")) / "engine.log"
    child = Child("engine", python_module("enginesim", "--port", str(port), "--time-scale", "0.01",
                                          "--max-model-len", "4096"), log).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    child.stop()


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_auto_tool_choice_calls_the_mentioned_tools_in_parallel(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("get_time, then get_weather in Oslo"),
                                       tools=[WEATHER, TIME], max_tokens=200)  # type: ignore[list-item]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time", "get_weather"]  # type: ignore[union-attr]
    assert len({c.id for c in calls}) == 2
    jsonschema.validate(json.loads(calls[1].function.arguments), WEATHER["function"]["parameters"])  # type: ignore[union-attr, index]


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("get_time, then get_weather"),
                                       tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=200)  # type: ignore[list-item]
    assert [c.function.name for c in r.choices[0].message.tool_calls or []] == ["get_time"]  # type: ignore[union-attr]


def test_a_tool_result_last_is_answered_in_text(client: openai.OpenAI) -> None:
    messages = [*ask("weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=50)  # type: ignore[arg-type, list-item]
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content


def test_a_system_reminder_after_the_user_s_turn_is_no_turn(client: openai.OpenAI) -> None:
    """Claude Code puts system turns after the user's (reminders): the model still answers the user's
    turn, calling the tool it names; after a tool result, it answers in text."""
    reminder = {"role": "system", "content": "Available agent types: general."}
    r = client.chat.completions.create(model=MODEL, messages=[*ask("get_weather please"), reminder],  # type: ignore[list-item]
                                       tools=[WEATHER, TIME], max_tokens=200)  # type: ignore[list-item]
    assert [c.function.name for c in r.choices[0].message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    messages = [*ask("weather?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, reminder]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=50)  # type: ignore[arg-type, list-item]
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content


@pytest.mark.parametrize("choice, finish", [("required", "tool_calls"),
                                            ({"type": "function", "function": {"name": "get_time"}}, "stop")])
def test_required_and_named_tool_choice(client: openai.OpenAI, choice: Any, finish: str) -> None:
    # vLLM's finish reasons: "tool_calls" for auto and required, "stop" for a named function.
    r = client.chat.completions.create(model=MODEL, messages=ask("hello"), tools=[WEATHER, TIME],  # type: ignore[list-item]
                                       tool_choice=choice, max_tokens=200)
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == finish
    assert [c.function.name for c in calls] == (["get_weather"] if choice == "required" else ["get_time"])  # type: ignore[union-attr]


def test_streamed_tool_calls_reassemble_to_the_json_answer(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": ask("get_weather and get_time please"),
                          "tools": [WEATHER, TIME], "max_tokens": 200, "seed": 7}
    whole = client.chat.completions.create(**kw)
    calls: dict[int, dict[str, str]] = {}
    deltas, finish = 0, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                deltas += 1
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += (d.function.name if d.function else None) or ""
                c["arguments"] += (d.function.arguments if d.function else None) or ""
    expected = [(c.function.name, c.function.arguments)  # type: ignore[union-attr]
                for c in whole.choices[0].message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected and len(expected) == 2
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())  # each call's id, sent once
    assert deltas > 2 and finish == "tool_calls"  # split across chunks, one token each


def test_max_tokens_cuts_tool_arguments_as_vllm_does(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("get_weather"), tools=[WEATHER], max_tokens=3)  # type: ignore[list-item]
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)  # type: ignore[union-attr]


def test_json_schema_output_parses_and_matches(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kw: dict[str, Any] = {"model": MODEL, "messages": ask("describe"), "max_tokens": 400, "response_format": {
            "type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}}
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content or ""
        jsonschema.validate(json.loads(text), SCHEMA)
    r = client.chat.completions.create(model=MODEL, messages=ask("x"), response_format={"type": "json_object"},
                                       max_tokens=100)
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model=MODEL, messages=ask("say something"), max_tokens=100, seed=3)
    text = base.choices[0].message.content or ""
    stop = text.split()[4]  # a word the answer holds
    r = client.chat.completions.create(model=MODEL, messages=ask("say something"), max_tokens=100, seed=3, stop=[stop])
    cut = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "stop" and stop not in cut and text.startswith(cut)
    assert r.choices[0].model_extra and r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage and base.usage and r.usage.completion_tokens < base.usage.completion_tokens
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ask("say something"), max_tokens=100, seed=3, stop=[stop], stream=True) if c.choices)
    assert streamed == cut


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert all(a.logprob <= t.logprob <= 0 for a in t.top_logprobs)
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=6, logprobs=True,
                                                        stream=True) if c.choices and c.choices[0].delta.content]
    assert all(c.choices[0].logprobs and len(c.choices[0].logprobs.content or []) == 1 for c in chunks)


def test_n_choices_differ_and_usage_sums_them(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=ask("two please"), max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage and r.usage.completion_tokens == 16


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages"),
])
def test_what_vllm_refuses(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": ask("x"), "max_tokens": 4, **kw})
    assert e.value.status_code == 400 and e.value.body["param"] == param  # type: ignore[index]


_schemas = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"},
                     {"type": "number"}, {"enum": ["a", "b", 3]}, {"type": ["string", "null"]}]),
    lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props)},
                  st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), inner, max_size=4)),
        st.builds(lambda items: {"type": "array", "items": items, "minItems": 1}, inner)),
    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(schema=_schemas, seed=st.integers(0, 2**32))
def test_generated_values_match_their_schema(schema: dict[str, Any], seed: int) -> None:
    jsonschema.validate(from_schema(schema, random.Random(seed)), schema)


def test_the_plan_is_deterministic() -> None:
    body = {"messages": ask("get_weather"), "tools": [WEATHER]}
    a, b = plan(body, 5, 40, "r1"), plan(body, 5, 40, "r1")
    assert a == b and a.tool_calls and a.natural_length == len(a.pieces) == len(a.owner)
