"""The Responses door's request side (extproc/shapes/openai/door.py): a Responses request as the internal
chat completion request, and every field it cannot carry refused by name. Its answers and streams are
held to their Python twin in tests/lua/test_lua_doors.py, and the whole door is tested through Envoy
with the openai SDK in tests/e2e/doors/test_sdk_matrix_e2e.py and test_responses_door_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc import chat, client_fields
from extproc.contract import ErrorCode, GatewayError
from extproc.shapes.openai.door import DOOR, request

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def internal(**doc: Any) -> dict[str, Any]:
    body = request(json.dumps({"model": "chat-default", **doc}).encode())
    client_fields.take(body)  # as intake does, then the chat completions contract takes what the door made
    chat.validate(body, max_messages=256, max_n=1)
    return body


def refused(**doc: Any) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        request(json.dumps({"model": "chat-default", **doc}).encode())
    return e.value


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    body = internal(input="hi", instructions="be brief", max_output_tokens=5)
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 5 and "stream" not in body


def test_a_codex_turn_with_its_tool_loop() -> None:
    """What Codex sends on its second request: developer instructions, the user's turn, the earlier
    answer's reasoning and function call as returned, the call's output; its tools and switches."""
    body = internal(
        instructions="You are Codex.", store=False, stream=True, parallel_tool_calls=False, tool_choice="auto",
        reasoning={"effort": "medium", "summary": "auto"}, include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1", client_metadata={"x-codex-turn": "1"},
        tools=[{"type": "function", "name": "exec_command", "description": "run", "strict": False,
                "parameters": SCHEMA}],
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: on"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "ls"}],
             "encrypted_content": "opaque"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Running ls.", "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "exec_command",
             "arguments": '{"cmd": "ls"}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
        ])
    assert body["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "sandbox: on"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running ls.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "exec_command", "description": "run",
                                                               "parameters": SCHEMA, "strict": False}}]
    assert body["reasoning_effort"] == "medium" and body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is False
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "client_metadata" not in body and "prompt_cache_key" not in body  # (taken at intake)


def test_function_calls_without_text_are_one_assistant_turn() -> None:
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(2)]
    outputs = [{"type": "function_call_output", "call_id": f"c{i}", "output": [{"type": "input_text", "text": "ok"}]}
               for i in range(2)]
    body = internal(input=[{"role": "user", "content": "go"}, *calls, *outputs])
    assistant = body["messages"][1]
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert [c["id"] for c in assistant["tool_calls"]] == ["c0", "c1"]
    assert [m["role"] for m in body["messages"][2:]] == ["tool", "tool"]


def test_structured_output_and_text_parts() -> None:
    body = internal(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "the plan, "}, {"type": "input_text", "text": "as JSON"}]}],
        text={"format": {"type": "json_schema", "name": "Answer", "schema": SCHEMA, "strict": True},
              "verbosity": "low"})
    assert body["messages"][0]["content"] == "the plan, as JSON"
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "Answer", "schema": SCHEMA, "strict": True}}
    assert body["verbosity"] == "low"


@pytest.mark.parametrize("doc, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f", "parameters": SCHEMA, "defer_loading": True}]},
     "tools.0.defer_loading"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": [{"type": "local_shell_call", "call_id": "c"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input.0.content.0"),
    ({"include": ["file_search_call.results"]}, "include.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_what_needs_a_store_or_a_tool_the_gateway_does_not_run_is_refused_by_name(doc: dict[str, Any],
                                                                                   param: str) -> None:
    err = refused(**{"input": "hi", **doc})
    assert err.code == ErrorCode.UNSUPPORTED_FIELD and err.param == param, err


def test_codex_tools_a_namespace_of_functions_and_a_built_in_one() -> None:
    """Codex's tools as it sends them: functions, `multi_agent_v1` (a namespace of functions) and the
    built-in `web_search`. The namespace's functions are `namespace__function` inside the gateway (the
    history's calls too); the built-in tool is left for the route to drop and report (a hint)."""
    spawn = {"type": "function", "name": "spawn_agent", "description": "start one", "parameters": SCHEMA}
    body = request(json.dumps({"model": "chat-default", "tools": [
        {"type": "function", "name": "exec_command", "parameters": SCHEMA},
        {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
            spawn, {**spawn, "name": "wait_agent"}]},
        {"type": "web_search", "external_web_access": False}],
        "input": [{"role": "user", "content": "go"},
                  {"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "started"}]}).encode())
    assert [t["function"]["name"] for t in body["tools"]] == [
        "exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"]
    assert body["tools"][1]["function"]["description"] == "start one"
    assert body["messages"][1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert body["llmgw_namespaces"] == ["multi_agent_v1"]
    assert body["llmgw_native"] == {"tools.2": "web_search"}
    assert DOOR.is_hint("tools.2") and not DOOR.is_hint("text.format")
    err = refused(input="hi", tools=[{"type": "namespace", "name": "bad name", "tools": [spawn]}])
    assert err.code == ErrorCode.INVALID_REQUEST and err.param == "tools.0.name", err


def test_a_request_without_a_message_is_invalid() -> None:
    err = refused(input=[])
    assert err.code == ErrorCode.INVALID_REQUEST and err.param == "input"
