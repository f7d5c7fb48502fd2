"""The adapters as pure translators (issue 13, first part): loss tables as data, requests to the
native shape and back, answers, streams split anywhere, errors; property-based round trips and a fuzz
of the stream translator (nothing but UpstreamBroken ever escapes it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.chat import CONTRACT_FIELDS, validate
from extproc.contract import ErrorCode
from extproc.shapes.anthropic.adapter import LOSS_TABLE, internal_body, native_body
from extproc.shapes.base import Target
from extproc.shapes.loss import Support, losses
from extproc.shapes.openai.adapter import OPENAI, VLLM_ONLY
from extproc.shapes.registry import adapter_for
from tests.helpers import feed_hostile
from tests.oracles.anthropic import ANTHROPIC
from tests.oracles.base import UpstreamBroken


def events(*docs: dict[str, Any]) -> bytes:
    return b"".join(f"event: {d['type']}\ndata: {json.dumps(d)}\n\n".encode() for d in docs)


def chunks_of(out: list[bytes]) -> list[Any]:
    text = b"".join(out).decode()
    return [json.loads(e[6:]) if e[6:] != "[DONE]" else "[DONE]" for e in text.split("\n\n") if e]


# -- loss tables ---------------------------------------------------------------------------------

def test_every_contract_field_is_declared_by_every_adapter() -> None:
    for table in (LOSS_TABLE, OPENAI.table("vllm"), OPENAI.table("openai"), OPENAI.table("azure")):
        assert set(CONTRACT_FIELDS) - {"model"} <= set(table), set(CONTRACT_FIELDS) - set(table)


def test_the_pool_loses_nothing_and_hosted_openai_loses_vllms_extras() -> None:
    body = {"model": "r", "messages": [], **{k: 1 for k in VLLM_ONLY}, "temperature": 0.5}
    assert losses(body, OPENAI.table("vllm")) == []
    assert sorted(x.field for x in losses(body, OPENAI.table("azure"))) == sorted(VLLM_ONLY)


@pytest.mark.parametrize("field", sorted(k for k, v in LOSS_TABLE.items() if v is Support.UNSUPPORTED))
def test_each_unsupported_anthropic_field_is_reported_and_never_sent(field: str) -> None:
    value: Any = {"seed": 7, "logit_bias": {"1": 2}, "response_format": {"type": "json_object"},
                  "logprobs": True, "top_logprobs": 2}.get(field, 1)
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], field: value}
    req = ANTHROPIC.request(body, Target("claude"))
    assert [(x.field, x.support) for x in req.losses] == [(field, Support.UNSUPPORTED)]
    assert field not in json.loads(req.body)


def test_conditional_losses_depend_on_the_value() -> None:
    base = {"model": "r", "messages": [{"role": "user", "content": "hi"}]}
    assert losses({**base, "temperature": 0.7, "n": 1}, LOSS_TABLE) == []
    lost = losses({**base, "temperature": 1.5, "n": 3, "response_format": {"type": "json_object"}}, LOSS_TABLE)
    assert [(x.field, x.support) for x in lost] == [("temperature", Support.TRANSFORMED), ("n", Support.UNSUPPORTED),
                                                    ("response_format", Support.UNSUPPORTED)]
    schema = {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}}
    req = ANTHROPIC.request({**base, "response_format": schema}, Target("c"))
    assert [(x.field, x.support) for x in req.losses] == [("response_format", Support.TRANSFORMED)]
    assert json.loads(req.body)["output_config"] == {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert internal_body(json.loads(req.body))["response_format"] == schema
    assert json.loads(ANTHROPIC.request({**base, "temperature": 1.5}, Target("c")).body)["temperature"] == 1


@pytest.mark.parametrize(("route_rule", "fields", "refused"), [
    # a contract follows the route's rule; a hint is reported whatever the route's rule
    ("reject", {}, ["n"]),
    ("report", {}, []),
    # a route may rule any one field: a hint made a contract, a contract reported
    ("reject", {"reasoning_effort": "reject", "n": "report"}, ["reasoning_effort"]),
    ("report", {"user": "reject"}, ["user"]),
])
def test_a_loss_is_ruled_per_field(route_rule: str, fields: dict[str, str], refused: list[str]) -> None:
    """Gemini's adapter carries neither `n` above 1 nor the hints (an end user's id, the effort):
    which of them refuses the request is each field's rule."""
    from extproc.config.schema import Route
    from extproc.shapes.gemini.adapter import LOSS_TABLE as GEMINI
    from extproc.stages.route import refused_losses
    body = {"model": "r", "messages": [{"role": "user", "content": "hi"}], "n": 2, "user": "u-1",
            "reasoning_effort": "low"}
    lost = losses(body, GEMINI)
    assert {x.field for x in lost if x.support is Support.UNSUPPORTED} >= {"n", "user", "reasoning_effort"}
    import yaml
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "policy/routes/chat-gemini.yaml").read_text())
    route = Route.model_validate({**doc, "translation_loss": route_rule, "translation_loss_fields": fields})
    assert sorted(x.field for x in refused_losses(route, lost)) == sorted(refused)


# -- requests --------------------------------------------------------------------------------------

def test_a_tool_conversation_becomes_alternating_turns_with_tool_blocks() -> None:
    # (image parts are refused at intake today; the adapter carries them for when a route admits them)
    body = {
        "model": "r", "max_tokens": 50, "stop": "END", "user": "u-1", "parallel_tool_calls": False,
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "messages": [
            {"role": "system", "content": "be brief"}, {"role": "developer", "content": "use tools"},
            {"role": "user", "content": [{"type": "text", "text": "order 7?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}},
                {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 8}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
            {"role": "tool", "tool_call_id": "c2", "content": "lost"},
            {"role": "user", "content": "thanks"}]}
    req = ANTHROPIC.request(body, Target("claude-x", "sk-ant", {}))
    native = json.loads(req.body)
    assert req.path == "/v1/messages" and req.headers["x-api-key"] == "sk-ant"
    assert req.headers["anthropic-version"] == "2023-06-01"
    assert native["system"] == "be brief\n\nuse tools" and native["max_tokens"] == 50
    assert native["stop_sequences"] == ["END"] and native["metadata"] == {"user_id": "u-1"}
    assert native["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert [t["role"] for t in native["messages"]] == ["user", "assistant", "user"]
    assert native["messages"][0]["content"][1]["source"] == {"type": "base64", "media_type": "image/png",
                                                              "data": "iVBO"}
    assert [b["input"] for b in native["messages"][1]["content"]] == [{"id": 7}, {"id": 8}]
    assert [b.get("tool_use_id") or b["text"] for b in native["messages"][2]["content"]] == ["c1", "c2", "thanks"]
    assert {(x.field, x.support) for x in req.losses} == {
        ("stop", Support.TRANSFORMED), ("user", Support.TRANSFORMED), ("parallel_tool_calls", Support.TRANSFORMED),
        ("tools", Support.TRANSFORMED), ("tool_choice", Support.TRANSFORMED)}


texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


@st.composite
def contract_requests(draw: st.DrawFn) -> dict[str, Any]:
    """Requests in the shape both APIs carry alike: a system prompt first, then alternating turns."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for i in range(draw(st.integers(1, 5))):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(texts)})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": draw(texts)})
    body: dict[str, Any] = {"model": "r", "messages": messages, "max_tokens": draw(st.integers(1, 4096))}
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 1))
    if draw(st.booleans()):
        body["top_p"] = draw(st.floats(0, 1))
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(texts, min_size=1, max_size=3))
    if draw(st.booleans()):
        body["stream"] = True
    if draw(st.booleans()):
        names = draw(st.lists(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), min_size=1, max_size=3, unique=True))
        body["tools"] = [{"type": "function", "function": {"name": n, "description": "",
                                                          "parameters": {"type": "object"}}} for n in names]
        body["tool_choice"] = draw(st.sampled_from(["auto", "required", "none",
                                                    {"type": "function", "function": {"name": names[0]}}]))
    return validate(body, 64, 8)


@settings(max_examples=200, deadline=None)
@given(contract_requests())
def test_a_request_survives_the_round_trip_and_every_change_is_reported(body: dict[str, Any]) -> None:
    req = ANTHROPIC.request(body, Target("r"))
    back = internal_body(json.loads(req.body))
    assert back == body
    reported = {x.field for x in req.losses}
    changed = {k for k in body if LOSS_TABLE.get(k) in (Support.TRANSFORMED, Support.EMULATED)}
    assert changed <= reported and all(x.support is not Support.UNSUPPORTED for x in req.losses)


# -- answers ----------------------------------------------------------------------------------------

MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "stop_reason": "tool_use",
           "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Let me look."},
                       {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"id": 7}}],
           "usage": {"input_tokens": 10, "cache_read_input_tokens": 90, "cache_creation_input_tokens": 5,
                     "output_tokens": 12}}


def test_a_message_becomes_a_chat_completion_with_normalised_usage() -> None:
    doc = ANTHROPIC.response(200, json.dumps(MESSAGE).encode())
    (choice,) = doc["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert choice["message"]["reasoning"] == "hmm"
    assert choice["message"]["tool_calls"] == [{"id": "tu_1", "type": "function",
                                                "function": {"name": "lookup", "arguments": '{"id": 7}'}}]
    assert doc["usage"] == {"prompt_tokens": 105, "completion_tokens": 12, "total_tokens": 117,
                            "prompt_tokens_details": {"cached_tokens": 90, "cache_write_tokens": 5}}
    for broken in (b"not json", b"[]", b'{"type": "message", "content": [{"type": "tool_use"}]}'):
        with pytest.raises(UpstreamBroken):
            ANTHROPIC.response(200, broken)


STREAM = events(
    {"type": "message_start", "message": {"id": "msg_2", "model": "claude-x", "usage": {
        "input_tokens": 20, "cache_read_input_tokens": 30, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Checking "}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "now."}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "tu_9", "name": "lookup",
                                                                   "input": {}}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"id": '}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '7, "x": "é"}'}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 17}},
    {"type": "message_stop"})


@pytest.mark.parametrize("step", [1, 3, 17, len(STREAM)])
def test_a_stream_split_anywhere_translates_to_the_same_chunks(step: int) -> None:
    t = ANTHROPIC.stream()
    out: list[bytes] = []
    for i in range(0, len(STREAM), step):
        out += t.feed(STREAM[i:i + step])
    out += t.finish()
    chunks = chunks_of(out)
    assert chunks[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"])
    calls = [tc for c in chunks[:-1] if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert content == "Checking now."
    assert calls[0]["id"] == "tu_9" and calls[0]["function"]["name"] == "lookup"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"id": 7, "x": "é"}
    assert {tc["index"] for tc in calls} == {0}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]][-1] == "tool_calls"
    assert chunks[-2]["usage"] == {"prompt_tokens": 50, "completion_tokens": 17, "total_tokens": 67,
                                   "prompt_tokens_details": {"cached_tokens": 30}}


def test_a_broken_stream_is_reported_not_finished() -> None:
    error = events({"type": "message_start", "message": {"id": "m", "usage": {}}},
                   {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    with pytest.raises(UpstreamBroken, match="overloaded_error"):
        ANTHROPIC.stream().feed(error)
    truncated = ANTHROPIC.stream()
    truncated.feed(STREAM[: STREAM.index(b"message_delta")])
    with pytest.raises(UpstreamBroken, match="before message_stop"):
        truncated.finish()
    without_usage = ANTHROPIC.stream(include_usage=False)
    assert all(b'"usage"' not in c for c in without_usage.feed(STREAM))


event_docs = st.fixed_dictionaries({"type": st.sampled_from(
    ["message_start", "content_block_start", "content_block_delta", "message_delta", "message_stop", "error",
     "ping", "content_block_stop"])}, optional={
    "index": st.integers(-2, 3) | st.text(max_size=3), "message": st.dictionaries(st.text(max_size=5), st.none()),
    "content_block": st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "x"])}),
    "delta": st.fixed_dictionaries({"type": st.sampled_from(["text_delta", "input_json_delta", "x"])},
                                   optional={"text": st.text(max_size=5), "partial_json": st.integers()}),
    "usage": st.none() | st.dictionaries(st.sampled_from(["output_tokens", "input_tokens"]), st.text(max_size=3))})


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64) | event_docs.map(lambda d: events(d)), max_size=12))
def test_nothing_but_upstream_broken_escapes_the_stream_translator(pieces: list[bytes]) -> None:
    feed_hostile(ANTHROPIC.stream(), pieces)


# -- errors and versions ----------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "body", "code", "retry"), [
    (529, b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}', ErrorCode.UPSTREAM_ERROR,
     "overloaded"),
    (429, b'{"type":"error","error":{"type":"rate_limit_error","message":"slow"}}', ErrorCode.UPSTREAM_ERROR,
     "rate_limited"),
    (400, b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 300000 tokens"}}',
     ErrorCode.CONTEXT_LENGTH_EXCEEDED, ""),
    (503, b"<html>bad gateway</html>", ErrorCode.UPSTREAM_ERROR, "unavailable"),
    (401, b'{"type":"error","error":{"type":"authentication_error","message":"bad key"}}', ErrorCode.UPSTREAM_ERROR,
     ""),
])
def test_provider_errors_map_to_the_contract(status: int, body: bytes, code: ErrorCode, retry: str) -> None:
    f = ANTHROPIC.failure(status, body)
    assert (f.code, f.retry) == (code, retry)


def test_adapters_are_named_with_their_version_and_azure_has_its_path() -> None:
    assert adapter_for("anthropic@1") is ANTHROPIC.adapter and adapter_for("openai-compat@1") is OPENAI
    with pytest.raises(KeyError):
        adapter_for("anthropic@2")
    with pytest.raises(KeyError):
        adapter_for("cohere@1")
    azure = Target("gpt-x", "az-key", {"kind": "azure", "deployment": "prod 1", "api_version": "2024-10-21"})
    req = OPENAI.request({"model": "r", "messages": [], "top_k": 5}, azure)
    assert req.path == "/openai/deployments/prod%201/chat/completions?api-version=2024-10-21"
    assert req.headers["api-key"] == "az-key" and "authorization" not in req.headers
    assert json.loads(req.body) == {"model": "gpt-x", "messages": []} and req.losses[0].field == "top_k"
    assert native_body({"model": "r", "messages": [{"role": "user", "content": "x"}]}, "m")["max_tokens"] == 4096


def test_the_providers_guide_shows_the_loss_table_as_the_adapters_declare_it() -> None:
    from pathlib import Path

    from llmgw.cli.adapters import loss_table

    assert loss_table() in (Path(__file__).parents[2] / "docs/guide/providers.md").read_text(), \
        "run: llmgw adapters loss-table, and paste it into docs/guide/providers.md"


def test_what_came_before_a_break_in_the_same_chunk_is_kept() -> None:
    chunk = STREAM[: STREAM.index(b"event: content_block_stop")] + events(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    with pytest.raises(UpstreamBroken) as e:
        ANTHROPIC.stream().feed(chunk)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks_of(e.value.partial) if c != "[DONE]")
    assert text == "Checking now."


@pytest.mark.parametrize(("adapter", "options", "problem"), [
    ("openai-compat@1", {"kind": "bogus"}, "kind must be one of"),
    ("openai-compat@1", {"region": "eu"}, "takes no option region"),
    ("anthropic@1", {"kind": "azure"}, "takes no option kind"),
    ("cohere@1", {}, "no such adapter"),
])
def test_a_deployments_adapter_and_options_are_checked_when_the_policy_loads(
        policy: Any, adapter: str, options: dict[str, str], problem: str) -> None:
    import yaml

    from extproc.config import ConfigError, load_snapshot

    path = policy / "deployments/pool-llama-8b.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["fingerprint"]["adapter"] = adapter
    doc["fingerprint"]["adapter_options"] = options
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        load_snapshot(policy)
    assert any(problem in i.message and i.file == "deployments/pool-llama-8b.yaml" for i in e.value.issues), \
        e.value.issues


def test_adapter_options_are_part_of_the_fingerprint() -> None:
    """Another Azure API version is another served system: its reference changes (so routes naming
    the old one, and evidence for it, no longer qualify it); no options keep the digest unchanged."""
    from extproc.config import load_snapshot
    from tests.conftest import POLICY

    fp = load_snapshot(POLICY).deployments["pool-llama-8b"].fingerprint
    same = fp.model_copy(update={"adapter_options": {}})
    v1 = fp.model_copy(update={"adapter_options": {"kind": "azure", "api_version": "2024-10-21"}})
    v2 = fp.model_copy(update={"adapter_options": {"kind": "azure", "api_version": "2025-01-01"}})
    assert same.digest() == fp.digest() and len({fp.digest(), v1.digest(), v2.digest()}) == 3


@pytest.mark.parametrize(("adapter", "options"), [("anthropic@1", {}), ("gemini@1", {}), ("bedrock@1", {}),
                                                  ("openai@1", {"kind": "openai"}),
                                                  ("openai@1", {"kind": "azure", "deployment": "d",
                                                                "api_version": "2024-10-21"})])
def test_every_header_an_adapter_sets_is_scrubbed_from_other_candidates_attempts(adapter: str,
                                                                                 options: dict[str, str]) -> None:
    """Envoy reuses an attempt's headers for the next: each header a candidate's adapter sets (its key,
    protocol version, signature) is in the attempt filter's list of what other candidates' attempts
    remove (the shapes registry's REQUEST_HEADERS); authorization is handled on its own."""
    from extproc.shapes.base import Target
    from extproc.shapes.registry import REQUEST_HEADERS, adapter_for

    credential = "AKIAEXAMPLE:secret" if adapter.startswith("bedrock") else "secret"
    for stream in (False, True):
        native = adapter_for(adapter).request({"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                              Target("m", credential, options, stream))
        names = {k.lower() for k in (*native.headers, *native.signed_headers)}
        assert names - {"content-type", "authorization", ":authority"} <= set(REQUEST_HEADERS), names


def test_each_shape_counts_as_its_provider_does() -> None:
    """A token count's request per shape: vLLM's /tokenize with the chat template, Anthropic's
    count_tokens, Gemini's countTokens of the whole request, Bedrock's signed CountTokens; OpenAI and
    Azure have none."""
    from extproc.shapes.base import Target
    from extproc.shapes.registry import adapter_for

    body = {"model": "r", "max_tokens": 1, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]}
    vllm = adapter_for("openai@1")
    assert not vllm.counts(Target("m", options={"kind": "openai"})) and vllm.counts(Target("m"))
    pool = vllm.count_request(body, Target("m"))
    assert pool.path == "/tokenize" and json.loads(pool.body)["add_generation_prompt"] is True
    assert json.loads(pool.body)["tools"] and json.loads(pool.body)["model"] == "m"
    a = adapter_for("anthropic@1").count_request(body, Target("claude", "k"))
    assert a.path == "/v1/messages/count_tokens" and a.headers["x-api-key"] == "k"
    assert set(json.loads(a.body)) == {"model", "messages", "system", "tools"}  # no max_tokens: it takes none
    g = adapter_for("gemini@1").count_request(body, Target("gem", "k"))
    assert g.path == "/v1beta/models/gem:countTokens"
    assert json.loads(g.body)["generateContentRequest"]["model"] == "models/gem"
    b = adapter_for("bedrock@1").count_request(body, Target("anthropic.claude", "AK:SK", {"region": "us-east-1"}))
    assert b.path == "/model/anthropic.claude/count-tokens" and set(json.loads(b.body)["input"]) == {"converse"}
    assert "authorization" in b.signed_headers  # signed over the count's own path and body
