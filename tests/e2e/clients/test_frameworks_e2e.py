"""The Python agent frameworks people build on, at their defaults, pointed at the gateway the way their
docs point them at any OpenAI- or Anthropic-compatible server (a base URL and a key), over every demo
route (the vLLM-shaped pool, the Anthropic-, Gemini- and Bedrock-shaped providers, the fallback plan):

- the OpenAI Agents SDK (its default model: the Responses API);
- LangChain's ChatOpenAI (chat completions) and ChatAnthropic (the Messages door);
- pydantic-ai's OpenAIChatModel and OpenAIResponsesModel.

Each runs a plain turn, a streamed turn, a tool loop (the model calls the framework's tool, the framework
runs it and sends its result back, the model answers) and a structured answer (the framework's own way
to ask for one: a JSON schema in `response_format` / `text.format`, or an output tool). Every request a
case sent is in the ledger, answered 200 on the route asked for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_head, settled_since, start_stack

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
ROUTES = ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback")
KINDS = ("plain", "stream", "tool_loop", "structured")
ASK = {"plain": "Say hello in one line.", "stream": "Say hello in one line.",
       "tool_loop": "Use read_note to read the note named plan, then say what it says.",
       "structured": "Plan the release: which day, and who owns it."}
NOTE = "the note says: ship on friday"


class Plan(BaseModel):
    day: str
    owner: str


class Notes:
    """The framework's tool: reads a note, and remembers that it was asked."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def read_note(self, name: str) -> str:
        """Read the note with this name."""
        self.read.append(name)
        return NOTE


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("frameworks"), simulate_providers=True)
    s.started_at = time.time()  # type: ignore[attr-defined]
    yield s
    s.stop()


def agents_sdk(url: str, route: str, kind: str, notes: Notes) -> Any:
    import agents
    from openai import AsyncOpenAI
    # The SDK's documented setup for another server: its client, and tracing (which would export to
    # OpenAI) off.
    agents.set_default_openai_client(AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY), use_for_tracing=False)
    agents.set_tracing_disabled(True)

    def read_note(name: str) -> str:
        """Read the note with this name."""
        return notes.read_note(name)
    agent: Any = agents.Agent(name="helper", instructions="You help.", model=route,
                              tools=[agents.function_tool(read_note)] if kind == "tool_loop" else [],
                              output_type=Plan if kind == "structured" else None)
    if kind != "stream":
        return agents.Runner.run_sync(agent, ASK[kind]).final_output

    async def streamed() -> Any:
        run = agents.Runner.run_streamed(agent, ASK[kind])
        deltas = [e async for e in run.stream_events() if getattr(e, "type", "") == "raw_response_event"]
        assert deltas, "no streamed event"
        return run.final_output
    return asyncio.run(streamed())


def langchain(provider: str) -> Callable[[str, str, str, Notes], Any]:
    def run(url: str, route: str, kind: str, notes: Notes) -> Any:
        from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
        from langchain_core.tools import tool
        model: Any
        if provider == "openai":
            from langchain_openai import ChatOpenAI
            model = ChatOpenAI(model=route, base_url=f"{url}/v1", api_key=KEY)  # type: ignore[arg-type]
        else:
            from langchain_anthropic import ChatAnthropic
            model = ChatAnthropic(model=route, base_url=url, api_key=KEY)  # type: ignore[call-arg, arg-type]
        if kind == "plain":
            return model.invoke(ASK[kind]).content
        if kind == "stream":
            pieces = list(model.stream(ASK[kind]))
            assert len(pieces) > 1, pieces
            return "".join(str(p.content) for p in pieces)
        if kind == "structured":
            return model.with_structured_output(Plan).invoke(ASK[kind])
        read = tool(notes.read_note)
        with_tools = model.bind_tools([read])
        messages: list[BaseMessage] = [HumanMessage(ASK[kind])]
        asked = with_tools.invoke(messages)
        messages.append(asked)
        messages += [ToolMessage(read.invoke(c["args"]), tool_call_id=c["id"]) for c in asked.tool_calls]
        return with_tools.invoke(messages).content
    return run


def pydantic_ai(api: str) -> Callable[[str, str, str, Notes], Any]:
    def run(url: str, route: str, kind: str, notes: Notes) -> Any:
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider
        model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(
            route, provider=OpenAIProvider(base_url=f"{url}/v1", api_key=KEY))

        def read_note(name: str) -> str:
            """Read the note with this name."""
            return notes.read_note(name)
        agent: Any = Agent(model, instructions="You help.", tools=[read_note] if kind == "tool_loop" else [],
                           output_type=Plan if kind == "structured" else str)
        if kind != "stream":
            return agent.run_sync(ASK[kind]).output

        async def streamed() -> str:
            async with agent.run_stream(ASK[kind]) as result:
                pieces = [t async for t in result.stream_text(delta=True)]
            assert pieces, "no streamed text"
            return "".join(pieces)
        return asyncio.run(streamed())
    return run


FRAMEWORKS: dict[str, Callable[[str, str, str, Notes], Any]] = {
    "openai-agents": agents_sdk, "langchain-openai": langchain("openai"), "langchain-anthropic": langchain("anthropic"),
    "pydantic-ai-chat": pydantic_ai("chat"), "pydantic-ai-responses": pydantic_ai("responses")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_framework_at_its_defaults_over_every_route(up: Stack, framework: str, route: str, kind: str) -> None:
    notes, start = Notes(), ledger_head(up)
    out = FRAMEWORKS[framework](up.url, route, kind, notes)
    if kind == "structured":
        assert isinstance(out, Plan) and out.day and out.owner, out
    else:
        assert isinstance(out, str) and out.strip(), out
    if kind == "tool_loop":
        assert notes.read, "the model never called the framework's tool"
    entries = settled_since(up, start)
    assert [(e["route"], e["status"]) for e in entries] == [(route, 200)] * len(entries), entries
    assert len(entries) >= (2 if kind == "tool_loop" else 1), entries


def test_the_run_left_every_hosted_candidate_qualified(up: Stack) -> None:
    """After the matrix (same module, same stack): the engine check that `llmgw up` runs every 30 s
    finds every hosted answer naming the model its deployment declares, so it would void nothing. (The
    callers read the route's name as the model; the ledger keeps the provider's.)"""
    from llmgw.ops import engines
    from llmgw.ops.store import store_client
    client = store_client(str(up.store_url))
    try:
        found = engines.answers_since(up.snapshot, client, up.started_at)  # type: ignore[attr-defined]
    finally:
        client.close()
    assert found == [], [str(f) for f in found]
