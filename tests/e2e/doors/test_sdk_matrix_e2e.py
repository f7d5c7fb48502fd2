"""Every SDK as its users write it (issue 30): the openai, anthropic and google-genai clients, each set
up with nothing but the gateway's URL and a key (google-genai's own default API version, no
`api_version`), against every demo route - the vLLM pool, the Anthropic-, Gemini- and Bedrock-shaped
providers and the fallback plan - for a JSON answer, a stream, a tool round trip written as each
SDK's examples write it (the Anthropic agent loop on `stop_reason`, OpenAI's forced function,
google-genai's automatic function calling with a Python function), structured output (a pydantic
class), and an error in the SDK's own class. Where a route's provider cannot carry what was asked
(structured output to the Bedrock-shaped one), the refusal names the field as the caller wrote it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
ROUTES = ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback")
DEPLOYMENT = {"chat-default": "pool-llama-8b", "chat-anthropic": "demo-anthropic", "chat-gemini": "demo-gemini",
              "chat-bedrock": "demo-bedrock", "chat-fallback": "pool-llama-8b"}
DOORS = ("openai", "anthropic", "gemini", "responses")  # (responses: the openai SDK's Responses API)
# Where each door's caller writes structured output: the refusal names it so.
STRUCTURED_FIELD = {"openai": "response_format", "anthropic": "output_config.format",
                    "gemini": "generationConfig.responseMimeType", "responses": "text.format"}


class Answer(BaseModel):
    city: str
    days: int


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("sdk-matrix"), simulate_providers=True)
    yield s
    s.stop()


_keep: list[Any] = []  # a genai Client closes its connection pool when collected


def openai_client(stack: Stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


def anthropic_client(stack: Stack, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0)


def genai_client(stack: Stack, key: str = KEY) -> genai.Client:
    c = genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=stack.url, retry_options=types.HttpRetryOptions(attempts=1)))
    _keep.append(c)
    return c


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# -- JSON ---------------------------------------------------------------------------------------------

def json_answer(stack: Stack, door: str, route: str) -> tuple[str, str, int]:
    """(text, request id, output tokens the SDK reports) of an 8-token answer."""
    if door == "openai":
        raw = openai_client(stack).chat.completions.with_raw_response.create(
            model=route, max_tokens=8, messages=ask(f"hello {route}"))
        c = raw.parse()
        assert c.choices[0].finish_reason == "length" and c.usage is not None
        assert c.model == route  # the route asked for; the served model is in x-llmgw-deployment
        return c.choices[0].message.content or "", raw.headers["x-request-id"], c.usage.completion_tokens
    if door == "responses":
        raw_r = openai_client(stack).responses.with_raw_response.create(model=route, max_output_tokens=8,
                                                                         input=f"hello {route}")
        r = raw_r.parse()
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens" and r.id.startswith("resp_") and r.usage is not None
        assert r.model == route  # the route asked for; the served model is in x-llmgw-deployment
        return r.output_text, raw_r.headers["x-request-id"], r.usage.output_tokens
    if door == "anthropic":
        m = anthropic_client(stack).messages.create(model=route, max_tokens=8, messages=ask(f"hello {route}"))
        assert m.stop_reason == "max_tokens" and m.id.startswith("msg_") and not m.id.startswith("msg_msg_")
        assert m.model == route  # (Claude Code keeps its signed thinking only for the model it asked)
        assert m._request_id  # the SDK's `request-id`
        return m.content[0].text, m._request_id, m.usage.output_tokens
    r = genai_client(stack).models.generate_content(model=route, contents=f"hello {route}",
                                                    config=types.GenerateContentConfig(max_output_tokens=8, top_k=5))
    assert r.candidates and r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert r.usage_metadata is not None and r.sdk_http_response is not None and r.model_version == route
    rid = (r.sdk_http_response.headers or {})["x-request-id"]
    return r.text or "", rid, r.usage_metadata.candidates_token_count or 0


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", DOORS)
def test_json(up: Stack, door: str, route: str) -> None:
    text, rid, output = json_answer(up, door, route)
    assert text and output == 8
    entry = ledger_of(up, rid, "acme")  # metered once, by the deployment that answered
    assert entry["usage"]["completion_tokens"] == 8 and entry["attempts"][-1]["deployment"] == DEPLOYMENT[route]


# -- streams ------------------------------------------------------------------------------------------

def streamed(stack: Stack, door: str, route: str) -> tuple[str, int]:
    """(the text, output tokens the final event reports) of a 9-token stream."""
    if door == "openai":
        chunks = list(openai_client(stack).chat.completions.create(
            model=route, max_tokens=9, stream=True, stream_options={"include_usage": True},
            messages=ask(f"stream {route}")))
        usage = chunks[-1].usage
        assert usage is not None and all(c.model == route for c in chunks)  # usage chunk too
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), usage.completion_tokens
    if door == "responses":
        events = list(openai_client(stack).responses.create(model=route, max_output_tokens=9, stream=True,
                                                            input=f"stream {route}"))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        last = events[-1]
        assert last.type == "response.incomplete" and last.response.usage is not None
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert last.response.output_text == text
        return text, last.response.usage.output_tokens
    if door == "anthropic":
        with anthropic_client(stack).messages.stream(model=route, max_tokens=9, messages=ask(f"stream {route}")) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert final.stop_reason == "max_tokens"
        return text, final.usage.output_tokens
    chunks = list(genai_client(stack).models.generate_content_stream(
        model=route, contents=f"stream {route}", config=types.GenerateContentConfig(max_output_tokens=9)))
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert last.usage_metadata is not None
    return "".join(c.text or "" for c in chunks), last.usage_metadata.candidates_token_count or 0


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", DOORS)
def test_stream(up: Stack, door: str, route: str) -> None:
    text, output = streamed(up, door, route)
    assert text and output == 9


# -- tools, as each SDK's examples write the loop ------------------------------------------------------

SEARCHED: list[str] = []  # what search_docs ran with, when the SDK calls it (automatic function calling)


def search_docs(query: str) -> str:
    """Search the gateway's docs for a query."""
    SEARCHED.append(query)
    return f"the docs say {query!r} is covered"


# google-genai reads a function's annotations as types when it calls it; this module's are strings
# (`from __future__ import annotations`), which a user's module usually does not have.
search_docs.__annotations__ = {"query": str, "return": str}


SCHEMA = {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}


def tool_loop(stack: Stack, door: str, route: str) -> tuple[list[str], str]:
    """(the queries the tool ran with, the final text) of a conversation that must use search_docs."""
    ran: list[str] = []
    if door == "anthropic":  # the agent loop: run tools while the model stops on tool_use
        client, messages = anthropic_client(stack), ask("use search_docs to find budgets")
        choice: dict[str, Any] = {"type": "tool", "name": "search_docs"}  # forced on the first turn
        while True:
            m = client.messages.create(model=route, max_tokens=120, messages=messages, tool_choice=choice,
                                       tools=[{"name": "search_docs", "description": "search", "input_schema": SCHEMA}])
            if m.stop_reason != "tool_use":
                return ran, "".join(b.text for b in m.content if b.type == "text")
            messages.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})  # as returned
            results = []
            for block in m.content:
                if block.type == "tool_use":
                    ran.append(block.input["query"])
                    results.append({"type": "tool_result", "tool_use_id": block.id,
                                    "content": search_docs(block.input["query"])})
            messages.append({"role": "user", "content": results})
            choice = {"type": "auto"}
            assert len(ran) < 4, "the loop never ended"
    if door == "responses":  # Codex's loop: run each function call, send the whole conversation back
        client = openai_client(stack)
        items: list[Any] = [{"role": "user", "content": "use search_docs to find budgets"}]
        fn: Any = [{"type": "function", "name": "search_docs", "parameters": SCHEMA, "strict": False}]
        forced: Any = {"type": "function", "name": "search_docs"}
        while True:
            *_, last = client.responses.create(model=route, max_output_tokens=120, input=items, tools=fn,
                                               tool_choice=forced, stream=True)
            assert last.type in ("response.completed", "response.incomplete"), last  # (incomplete: a long answer)
            r = last.response
            calls = [o for o in r.output if o.type == "function_call"]
            if not calls:
                return ran, r.output_text
            items += [o.model_dump(exclude_none=True) for o in r.output]  # as returned, reasoning included
            for call in calls:
                query = json.loads(call.arguments)["query"]
                ran.append(query)
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": search_docs(query)})
            forced = "auto"
            assert len(ran) < 4, "the loop never ended"
    if door == "openai":  # a forced function, its result, the answer
        client = openai_client(stack)
        msgs: list[Any] = ask("use search_docs to find budgets")
        tools: Any = [{"type": "function", "function": {"name": "search_docs", "parameters": SCHEMA}}]
        c = client.chat.completions.create(model=route, max_tokens=120, messages=msgs, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "search_docs"}})
        msg = c.choices[0].message
        assert msg.tool_calls
        msgs.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            query = json.loads(call.function.arguments)["query"]
            ran.append(query)
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": search_docs(query)})
        c = client.chat.completions.create(model=route, max_tokens=40, messages=msgs, tools=tools)
        return ran, c.choices[0].message.content or ""

    # google-genai's automatic function calling: a Python function, called by the SDK itself.
    SEARCHED.clear()
    r = genai_client(stack).models.generate_content(
        model=route, contents="use search_docs to find budgets",
        config=types.GenerateContentConfig(max_output_tokens=120, tools=[search_docs]))
    return list(SEARCHED), r.text or ""


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", DOORS)
def test_tools(up: Stack, door: str, route: str) -> None:
    ran, final = tool_loop(up, door, route)
    assert len(ran) >= 1 and all(isinstance(q, str) and q for q in ran)
    assert final  # the tool's result was answered in text


# -- structured output --------------------------------------------------------------------------------

def structured(stack: Stack, door: str, route: str) -> Answer:
    if door == "responses":
        r = openai_client(stack).responses.parse(model=route, max_output_tokens=60, input="the weather plan",
                                                 text_format=Answer)
        assert r.output_parsed is not None
        return r.output_parsed
    if door == "openai":
        c = openai_client(stack).chat.completions.parse(model=route, max_tokens=60, response_format=Answer,
                                                        messages=ask("the weather plan"))
        assert c.choices[0].message.parsed is not None
        return c.choices[0].message.parsed
    if door == "anthropic":
        m = anthropic_client(stack).messages.create(
            model=route, max_tokens=60, messages=ask("the weather plan"),
            output_config={"format": {"type": "json_schema", "schema": Answer.model_json_schema()}})
        return Answer.model_validate_json(m.content[0].text)
    r = genai_client(stack).models.generate_content(
        model=route, contents="the weather plan",
        config=types.GenerateContentConfig(max_output_tokens=60, response_mime_type="application/json",
                                           response_schema=Answer))
    assert isinstance(r.parsed, Answer)
    return r.parsed


def status_and_body(e: BaseException) -> tuple[int, str]:
    if isinstance(e, genai_errors.APIError):
        return e.code, json.dumps(e.details)
    assert isinstance(e, (openai.APIStatusError, anthropic.APIStatusError)), e
    return e.status_code, json.dumps(e.body)


ERRORS: dict[str, tuple[type[BaseException], ...]] = {
    "openai": (openai.BadRequestError,), "responses": (openai.BadRequestError,),
    "anthropic": (anthropic.BadRequestError,), "gemini": (genai_errors.ClientError,)}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", DOORS)
def test_structured_output(up: Stack, door: str, route: str) -> None:
    """Every route answers as the schema asks (Bedrock's through a tool the model must call)."""
    out = structured(up, door, route)
    assert out.city and isinstance(out.days, int)


LIST_OF_CITIES = {"type": "array", "items": {"type": "string"}}
AS_A_LIST: dict[str, Callable[[Stack], Any]] = {  # a schema whose root is no object, as each door's caller asks
    "responses": lambda s: openai_client(s).responses.create(
        model="chat-bedrock", max_output_tokens=60, input="cities",
        text={"format": {"type": "json_schema", "name": "cities", "schema": LIST_OF_CITIES}}),
    "openai": lambda s: openai_client(s).chat.completions.create(
        model="chat-bedrock", max_tokens=60, messages=ask("cities"), response_format={
            "type": "json_schema", "json_schema": {"name": "cities", "schema": LIST_OF_CITIES}}),
    "anthropic": lambda s: anthropic_client(s).messages.create(
        model="chat-bedrock", max_tokens=60, messages=ask("cities"),
        output_config={"format": {"type": "json_schema", "schema": LIST_OF_CITIES}}),
    "gemini": lambda s: genai_client(s).models.generate_content(
        model="chat-bedrock", contents="cities", config=types.GenerateContentConfig(
            max_output_tokens=60, response_mime_type="application/json", response_json_schema=LIST_OF_CITIES)),
}


@pytest.mark.parametrize("door", DOORS)
def test_a_schema_bedrock_cannot_take_is_refused_naming_the_callers_field(up: Stack, door: str) -> None:
    """Converse takes a schema only as a tool's input, an object: the route refuses (reject) a list,
    naming the field as this caller wrote it."""
    with pytest.raises(ERRORS[door]) as e:
        AS_A_LIST[door](up)
    status, body = status_and_body(e.value)
    assert status == 400 and "unsupported_field" in body and f"`{STRUCTURED_FIELD[door]}`" in body


# -- errors, in each SDK's own classes ----------------------------------------------------------------

GLOBEX = DEMO_KEYS["globex"]
FORBIDDEN: dict[str, Callable[[Stack, str], Any]] = {
    # A tool the catalog does not list, from a tenant whose rule refuses unlisted tools: the policy
    # refuses it (403 forbidden) on every route.
    "openai": lambda s, route: openai_client(s, GLOBEX).chat.completions.create(
        model=route, max_tokens=4, messages=ask("x"),
        tools=[{"type": "function", "function": {"name": "wire_money", "parameters": SCHEMA}}]),
    "anthropic": lambda s, route: anthropic_client(s, GLOBEX).messages.create(
        model=route, max_tokens=4, messages=ask("x"),
        tools=[{"name": "wire_money", "input_schema": SCHEMA}]),
    "responses": lambda s, route: openai_client(s, GLOBEX).responses.create(
        model=route, max_output_tokens=4, input="x",
        tools=[{"type": "function", "name": "wire_money", "parameters": SCHEMA, "strict": False}]),
    "gemini": lambda s, route: genai_client(s, GLOBEX).models.generate_content(
        model=route, contents="x", config=types.GenerateContentConfig(
            max_output_tokens=4, tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
                name="wire_money", parameters_json_schema=SCHEMA)])],
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))),
}
FORBIDDEN_CLASS: dict[str, type[BaseException]] = {
    "openai": openai.PermissionDeniedError, "responses": openai.PermissionDeniedError,
    "anthropic": anthropic.PermissionDeniedError,
    "gemini": genai_errors.ClientError}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", DOORS)
def test_errors(up: Stack, door: str, route: str) -> None:
    with pytest.raises(FORBIDDEN_CLASS[door]) as e:
        FORBIDDEN[door](up, route)
    status, body = status_and_body(e.value)
    assert status == 403 and "forbidden" in body and "wire_money" in body
    if door == "gemini":  # Google's shape: an integer code, the status name, the contract's reason
        err = e.value.details["error"]
        assert err["code"] == 403 and err["status"] == "PERMISSION_DENIED"
        assert err["details"][0]["reason"] == "forbidden"


# -- what each door's users meet besides the matrix ---------------------------------------------------

@pytest.mark.parametrize("version", ["v1", "v1beta", "v1alpha"])
def test_google_genai_on_any_api_version(up: Stack, version: str) -> None:
    c = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=up.url, api_version=version))
    _keep.append(c)
    r = c.models.generate_content(model="chat-default", contents="hi", config=types.GenerateContentConfig(
        max_output_tokens=3))
    assert r.text and r.usage_metadata is not None and r.usage_metadata.candidates_token_count == 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["chat-default", "chat-anthropic", "chat-bedrock"])
def test_a_stop_sequence_is_reported_as_anthropic_reports_it(up: Stack, route: str, stream: bool) -> None:
    """The sequence that cut the text, from the pool (vLLM's `stop_reason`), an Anthropic-shaped
    provider (`stop_sequence`) and a Bedrock-shaped one (its model's own `stop_sequence` field). A
    Gemini-shaped provider does not say which sequence stopped it: `end_turn` there."""
    kw: Any = {"model": route, "max_tokens": 60, "stop_sequences": ["e"], "messages": ask("write a sentence")}
    if stream:
        with anthropic_client(up).messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = anthropic_client(up).messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "e")
    assert "e" not in m.content[0].text


@pytest.mark.parametrize("door, route, call, field", [
    ("anthropic", "chat-bedrock", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                                   "tools": [{"name": "search_docs", "input_schema": SCHEMA}]},
     "tool_choice.disable_parallel_tool_use"),
    ("gemini", "chat-anthropic", {"candidate_count": 2}, "generationConfig.candidateCount"),
    ("gemini", "chat-anthropic", {"response_mime_type": "application/json"}, "generationConfig.responseMimeType"),
])
def test_a_refusal_names_the_field_as_the_caller_wrote_it(up: Stack, door: str, route: str, call: dict[str, Any],
                                                           field: str) -> None:
    with pytest.raises(ERRORS[door]) as e:
        if door == "anthropic":
            anthropic_client(up).messages.create(model=route, max_tokens=5, messages=ask("x"), **call)
        else:
            genai_client(up).models.generate_content(model=route, contents="x", config=types.GenerateContentConfig(
                max_output_tokens=5, **call))
    status, body = status_and_body(e.value)
    assert status == 400 and "unsupported_field" in body and f"`{field}`" in body


# -- the fields current OpenAI clients send (docs/FIELDS.md) -------------------------------------------

def engine_fields(stack: Stack, marker: str) -> list[str]:
    """The request fields that reached a pool engine with `marker` in its messages."""
    from tests.helpers import request
    (entry,) = [e for url in stack.engine_urls() for e in request(f"{url}/admin/requests").json()
                if marker in json.dumps(e["messages"])]
    return list(entry["fields"])


def test_what_the_gateway_answers_itself_never_reaches_an_engine(up: Stack) -> None:
    marker = "fields-owned-7f3"
    raw = openai_client(up).chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=3, messages=ask(marker), store=False, service_tier="auto",
        modalities=["text"], prompt_cache_key="k-1", metadata={"team": "search", "job": "nightly"},
        reasoning_effort="low")
    assert raw.parse().choices[0].message.content
    sent = engine_fields(up, marker)
    assert not {"store", "service_tier", "modalities", "prompt_cache_key", "metadata"} & set(sent)
    assert "reasoning_effort" in sent  # vLLM takes it: passed to the pool
    entry = ledger_of(up, raw.headers["x-request-id"], "acme")
    assert entry["metadata"] == {"team": "search", "job": "nightly"}  # the caller's tags, for attribution


@pytest.mark.parametrize("route, kw, field", [
    ("chat-default", {"store": True}, "store"),
    ("chat-default", {"service_tier": "priority"}, "service_tier"),
    ("chat-default", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat-gemini", {"n": 2}, "n"),  # a contract: the caller relies on two choices
])
def test_a_field_no_candidate_honours_is_refused_naming_it(up: Stack, route: str, kw: dict[str, Any],
                                                           field: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(up).chat.completions.create(model=route, max_tokens=3, messages=ask("x"), **kw)
    assert e.value.code == "unsupported_field" and (e.value.param or "").startswith(field)


# -- model lookups, in the shape of the SDK that asks --------------------------------------------------

@pytest.mark.parametrize("version", ["v1beta", "v1"])
def test_google_genai_models_get_and_list(up: Stack, version: str) -> None:
    c = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=up.url, api_version=version))
    _keep.append(c)
    m = c.models.get(model="chat-default")
    assert m.name == "models/chat-default" and m.output_token_limit == 4096 and (m.input_token_limit or 0) > 0
    assert {x.name for x in c.models.list()} == {f"models/{r}" for r in ROUTES}
    with pytest.raises(genai_errors.ClientError) as e:
        c.models.get(model="no-such-route")
    assert e.value.code == 404 and e.value.details["error"]["details"][0]["reason"] == "route_not_found"


def test_an_endpoint_the_gateway_does_not_serve_is_named_in_each_sdks_error(up: Stack) -> None:
    """The SDKs' other APIs (Anthropic's batches, OpenAI's legacy completions): a 404 in the SDK's own
    shape that says what the gateway does serve."""
    with pytest.raises(anthropic.NotFoundError) as a:
        anthropic_client(up).messages.batches.list()
    assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "not_found_error"
    assert a.value.body["error"]["message"].startswith("no such endpoint: GET /v1/messages/batches; this gateway "
                                                       "serves POST /v1/chat/completions")
    with pytest.raises(openai.NotFoundError) as o:
        openai_client(up).completions.create(model="chat-default", prompt="hi")
    assert o.value.code == "route_not_found" and "POST /v1/responses" in o.value.message


def test_anthropic_and_openai_models_retrieve_and_list(up: Stack) -> None:
    a = anthropic_client(up).models.retrieve("chat-anthropic")
    assert a.type == "model" and a.id == "chat-anthropic" and a.display_name == "chat-anthropic"
    assert {m.id for m in anthropic_client(up).models.list()} == set(ROUTES)
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client(up).models.retrieve("no-such-route")
    assert e.value.body["error"]["code"] == "route_not_found"  # Anthropic's shape, the contract's code
    o = openai_client(up).models.retrieve("chat-default")
    assert o.object == "model" and o.owned_by == "llmgw"
    # OpenAI's list holds the embeddings route too (its SDK embeds); the doors' SDKs call chat routes only.
    assert {m.id for m in openai_client(up).models.list()} == {*ROUTES, "embed-default"}


# -- token counting, nothing generated or charged ------------------------------------------------------

def counted_and_used(stack: Stack, door: str, route: str) -> tuple[int, str, int]:
    """(the count, its request id, the prompt tokens a 1-token generation of the same request used)."""
    text = f"count these tokens for {route}"
    if door == "anthropic":
        c = anthropic_client(stack).messages.count_tokens(model=route, system="Be brief.", messages=ask(text))
        m = anthropic_client(stack).messages.create(model=route, max_tokens=1, system="Be brief.", messages=ask(text))
        return c.input_tokens, c._request_id or "", m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    g = genai_client(stack)
    n = g.models.count_tokens(model=route, contents=text)
    r = g.models.generate_content(model=route, contents=text, config=types.GenerateContentConfig(max_output_tokens=1))
    assert n.sdk_http_response is not None and r.usage_metadata is not None
    return n.total_tokens or 0, (n.sdk_http_response.headers or {})["x-request-id"], \
        r.usage_metadata.prompt_token_count or 0


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("door", ["anthropic", "gemini"])
def test_a_token_count_is_the_candidates_own_and_charged_nothing(up: Stack, door: str, route: str) -> None:
    """Anthropic's count_tokens and Gemini's countTokens, answered by the route's first qualified
    candidate (the pool's /tokenize, each provider's own count): the same number its generation
    reports as prompt tokens; one ledger entry marked as a count, charged nothing."""
    n, rid, used = counted_and_used(up, door, route)
    assert n == used > 0
    entry = ledger_of(up, rid, "acme")
    assert entry["count"] == {"chat-default": "openai", "chat-fallback": "openai"}.get(route, route.split("-")[1])
    assert (entry["settlement"], entry["charged_micros"], entry["charged_tokens"]) == ("released", 0, 0)
    assert entry["counted_tokens"] == n and entry["usage"] is None  # no reader sums it as tokens processed
    assert entry["attempts"][-1]["deployment"] == DEPLOYMENT[route]
    if DEPLOYMENT[route] == "pool-llama-8b":  # the engine's tokenizer, asked without the caller's key
        from tests.helpers import request
        (seen,) = [e for url in up.engine_urls() for e in request(f"{url}/admin/requests").json()
                   if e["path"] == "/tokenize" and f"for {route}" in json.dumps(e["messages"])
                   and e["request_id"] == rid]
        assert not seen["authorization_present"] and not seen["api_key_present"]


def test_a_bearer_credential_never_reaches_the_engine_that_counts(up: Stack) -> None:
    """The anthropic SDK with `auth_token` sends the gateway key as a bearer token: it never reaches the
    engine that counts (the header allow-list drops it; the count route's removal list, checked in
    tests/e2e/config/test_envoy_render.py, would too)."""
    c = anthropic.Anthropic(base_url=up.url, auth_token=KEY, max_retries=0).messages.count_tokens(
        model="chat-default", messages=ask("bearer count"))
    from tests.helpers import request
    (seen,) = [e for url in up.engine_urls() for e in request(f"{url}/admin/requests").json()
               if e["path"] == "/tokenize" and e["request_id"] == c._request_id]
    assert c.input_tokens > 0 and not seen["authorization_present"]


# -- a door's own fields, for a plan of its shape ------------------------------------------------------

SAFETY = [types.SafetySetting(category=types.HarmCategory.HARM_CATEGORY_HARASSMENT,
                              threshold=types.HarmBlockThreshold.BLOCK_ONLY_HIGH)]


def provider_fields(stack: Stack, deployment: str, marker: str) -> list[str]:
    from tests.helpers import request
    (host, port), = stack.render.providers[deployment]
    (entry,) = [e for e in request(f"http://{host}:{port}/admin/requests").json()
                if marker in json.dumps(e["messages"])]
    return list(entry["fields"])


def test_geminis_safety_settings_reach_a_gemini_candidate_unchanged(up: Stack) -> None:
    marker = "safety-escape-91"
    r = genai_client(up).models.generate_content(
        model="chat-gemini", contents=marker,
        config=types.GenerateContentConfig(max_output_tokens=3, safety_settings=SAFETY))
    assert r.text and "safetySettings" in provider_fields(up, "demo-gemini", marker)


def test_anthropics_service_tier_reaches_an_anthropic_candidate_unchanged(up: Stack) -> None:
    marker = "tier-escape-17"
    m = anthropic_client(up).messages.create(model="chat-anthropic", max_tokens=3, messages=ask(marker),
                                             service_tier="standard_only")
    assert m.content and "service_tier" in provider_fields(up, "demo-anthropic", marker)


@pytest.mark.parametrize("door, route", [("gemini", "chat-default"), ("gemini", "chat-anthropic"),
                                         ("anthropic", "chat-fallback"), ("anthropic", "chat-bedrock")])
def test_a_doors_own_field_is_refused_where_the_plan_may_try_another_shape(up: Stack, door: str, route: str) -> None:
    """Under `reject`, naming the field: the pool, another provider's shape, or a fallback plan whose
    first candidate is the pool (chat-fallback) would not carry it."""
    with pytest.raises(ERRORS[door]) as e:
        if door == "gemini":
            genai_client(up).models.generate_content(model=route, contents="x", config=types.GenerateContentConfig(
                max_output_tokens=3, safety_settings=SAFETY))
        else:
            anthropic_client(up).messages.create(model=route, max_tokens=3, messages=ask("x"), service_tier="auto")
    status, body = status_and_body(e.value)
    field = "safetySettings" if door == "gemini" else "service_tier"
    assert status == 400 and "unsupported_field" in body and f"`{field}`" in body


@pytest.mark.parametrize("door, route, field", [("gemini", "chat-default", "generationConfig.thinkingConfig"),
                                                ("anthropic", "chat-fallback", "thinking"),
                                                ("anthropic", "chat-gemini", "output_config.effort"),
                                                ("anthropic", "chat-default", "context_management"),
                                                # (hints of the contract itself: extproc/shapes/loss.py)
                                                ("anthropic", "chat-gemini", "metadata.user_id"),
                                                ("openai", "chat-anthropic", "reasoning_effort"),
                                                ("openai", "chat-default", "verbosity")])
def test_a_hint_is_dropped_and_reported_where_the_plan_may_try_another_shape(up: Stack, door: str, route: str,
                                                                             field: str) -> None:
    """A hint (a thinking switch, the effort, context management, an end user's id, the verbosity: what
    Gemini CLI and Claude Code send on every request) never refuses a request, even on a `reject` route: a
    candidate that cannot carry it is served without it, and the answer and the ledger name it, as the
    caller wrote it."""
    if door == "gemini":
        r = genai_client(up).models.generate_content(model=route, contents="x", config=types.GenerateContentConfig(
            max_output_tokens=3, thinking_config=types.ThinkingConfig(include_thoughts=True, thinking_budget=64)))
        assert r.sdk_http_response is not None
        headers = r.sdk_http_response.headers or {}
    elif door == "openai":
        hint: dict[str, Any] = {"reasoning_effort": {"reasoning_effort": "low"}, "verbosity": {"verbosity": "low"}}
        raw_chat = openai_client(up).chat.completions.with_raw_response.create(
            model=route, max_tokens=2000, messages=ask("x"), **hint[field])
        assert raw_chat.parse().choices[0].message.content
        headers = dict(raw_chat.headers)
    else:
        own: dict[str, Any] = {
            "metadata.user_id": {"metadata": {"user_id": "u-1"}},
            "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "output_config.effort": {"output_config": {"effort": "low"}},
            # (a beta field: this SDK sends it only as an extra field, as Claude Code writes its body)
            "context_management": {"extra_body": {"context_management": {
                "edits": [{"type": "clear_tool_uses_20250919"}]}}}}[field]
        raw = anthropic_client(up).messages.with_raw_response.create(model=route, max_tokens=2000,
                                                                     messages=ask("x"), **own)
        assert raw.parse().content
        headers = dict(raw.headers)
    assert f"{field} (unsupported" in headers["x-llmgw-translation-loss"], headers
    entry = ledger_of(up, headers["x-request-id"], "acme")
    assert any(x.startswith(f"{field} (unsupported") for x in entry["attempts"][-1]["translation_loss"]), entry


def test_claude_code_s_own_fields_reach_an_anthropic_candidate_unchanged(up: Stack) -> None:
    """The effort and context management as Claude Code sends them, and a system turn inside the
    conversation, to an Anthropic-shaped candidate: as they came (the turn hoisted into `system`)."""
    marker = "effort-escape-23"
    m = anthropic_client(up).messages.create(
        model="chat-anthropic", max_tokens=50, output_config={"effort": "high"},
        extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
        messages=[{"role": "user", "content": marker}, {"role": "assistant", "content": "ok"},
                  {"role": "system", "content": "The user's files changed."},  # type: ignore[misc,list-item]
                  {"role": "user", "content": "go on"}])
    assert m.content
    sent = provider_fields(up, "demo-anthropic", marker)
    assert {"output_config", "context_management", "system"} <= set(sent)


# -- prompt caching: a breakpoint reaches the provider that caches only when asked -----------------------

PREAMBLE = "a long shared preamble for the cache " * 30
EPHEMERAL = {"type": "ephemeral"}


@pytest.mark.parametrize("door", ["anthropic", "openai"])
def test_a_caching_breakpoint_reaches_an_anthropic_provider_and_its_reads_are_billed(up: Stack, door: str) -> None:
    """The provider caches only a prompt marked with `cache_control` (as Anthropic does): the second
    request's cache reads prove the breakpoint was carried, from the Anthropic door's system block or
    the OpenAI door's content part, and the ledger bills them as cached input."""
    def ask_cached(marked: bool) -> tuple[int, int, str]:
        hint = {"cache_control": EPHEMERAL} if marked else {}
        if door == "anthropic":
            raw = anthropic_client(up).messages.with_raw_response.create(
                model="chat-anthropic", max_tokens=2, system=[{"type": "text", "text": door + PREAMBLE, **hint}],
                messages=ask(f"cached {marked}"))
            m = raw.parse()
            return m.usage.cache_read_input_tokens or 0, m.usage.input_tokens, raw.headers["x-request-id"]
        raw = openai_client(up).chat.completions.with_raw_response.create(
            model="chat-anthropic", max_tokens=2, messages=[
                {"role": "system", "content": [{"type": "text", "text": door + PREAMBLE, **hint}]},  # type: ignore[list-item, typeddict-unknown-key]
                {"role": "user", "content": f"cached {marked}"}])
        c = raw.parse()
        assert c.usage is not None and c.usage.prompt_tokens_details is not None
        cached = c.usage.prompt_tokens_details.cached_tokens or 0
        return cached, c.usage.prompt_tokens - cached, raw.headers["x-request-id"]

    first, _, _ = ask_cached(True)
    again, uncached, rid = ask_cached(True)
    assert first == 0 and again > 0
    details = ledger_of(up, rid, "acme")["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == again
    assert ask_cached(False)[0] == 0 and ask_cached(False)[0] == 0  # unmarked: nothing cached
    assert uncached >= 0


def test_a_caching_breakpoint_to_the_pool_is_emulated_not_sent(up: Stack) -> None:
    """The pool caches prefixes on its own: the breakpoint is not sent (vLLM would ignore it, OpenAI
    would refuse it), and a `reject` route serves the request."""
    marker = "pool-cache-58"
    m = anthropic_client(up).messages.create(model="chat-default", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "text", "text": marker, "cache_control": EPHEMERAL}]}])
    assert m.content
    from tests.helpers import request
    sent = [e for url in up.engine_urls() for e in request(f"{url}/admin/requests").json()
            if marker in json.dumps(e.get("messages"))]
    assert sent and "cache_control" not in json.dumps(sent)


# -- thinking: the provider's own switch in, its reasoning out in the caller's shape -------------------------

THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_anthropic_thinking_comes_back_as_a_signed_thinking_block(up: Stack) -> None:
    marker = "think-json-33"
    raw = anthropic_client(up).messages.with_raw_response.create(model="chat-anthropic", max_tokens=2000,
                                                                messages=ask(marker), thinking=THINKING)
    m = raw.parse()
    assert [b.type for b in m.content] == ["thinking", "text"]
    thinking = m.content[0]
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking and thinking.signature
    assert "thinking" in provider_fields(up, "demo-anthropic", marker)
    # Thinking is output: the ledger charges what the provider counted, thoughts included.
    entry = ledger_of(up, raw.headers["x-request-id"], "acme")
    assert entry["usage"]["completion_tokens"] == m.usage.output_tokens > len(thinking.thinking.split())


def test_anthropic_thinking_streams_as_thinking_deltas_with_the_signature(up: Stack) -> None:
    with anthropic_client(up).messages.stream(model="chat-anthropic", max_tokens=2000, messages=ask("think-stream"),
                                              thinking=THINKING) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    assert kinds.index("signature_delta") < kinds.index("text_delta")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].signature and final.stop_reason == "end_turn"  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_loop_with_thinking_replays_the_signed_block(up: Stack, stream: bool) -> None:
    """Anthropic's tool loop with thinking on: the assistant turn goes back with its thinking block as
    signed, and the provider (which checks the signature) takes it - the gateway carried it whole both
    ways."""
    client = anthropic_client(up)
    history: list[Any] = ask("use search_docs for budgets")
    tools = [{"name": "search_docs", "description": "search", "input_schema": SCHEMA}]
    if stream:
        with client.messages.stream(model="chat-anthropic", max_tokens=2000, messages=history, tools=tools,
                                    thinking=THINKING) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(model="chat-anthropic", max_tokens=2000, messages=history, tools=tools,
                                       thinking=THINKING)
    assert first.stop_reason == "tool_use" and first.content[0].type == "thinking"
    call = next(b for b in first.content if b.type == "tool_use")
    history += [{"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "found"}]}]
    done = client.messages.create(model="chat-anthropic", max_tokens=2000, messages=history, tools=tools,
                                  thinking=THINKING)
    assert done.stop_reason == "end_turn" and done.content[-1].type == "text"
    # A thinking block altered on the way back is the provider's 400, as the provider words it.
    tampered = [*history[:1], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": first.content[0].thinking + " (edited)",  # type: ignore[union-attr]
         "signature": first.content[0].signature}, *first.content[1:]]}, history[2]]  # type: ignore[union-attr]
    with pytest.raises(anthropic.APIStatusError):
        client.messages.create(model="chat-anthropic", max_tokens=2000, messages=tampered, tools=tools,
                               thinking=THINKING)


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_thoughts_come_back_as_thought_parts_counted_apart(up: Stack, stream: bool) -> None:
    config = types.GenerateContentConfig(max_output_tokens=400, thinking_config=types.ThinkingConfig(
        include_thoughts=True, thinking_budget=64))
    client = genai_client(up)
    if stream:
        pieces = list(client.models.generate_content_stream(model="chat-gemini", contents="think-gem", config=config))
        parts = [p for r in pieces if r.candidates for p in (r.candidates[0].content.parts or ())  # type: ignore[union-attr]
                 if p.text]
        usage = pieces[-1].usage_metadata
    else:
        r = client.models.generate_content(model="chat-gemini", contents="think-gem", config=config)
        parts = list(r.candidates[0].content.parts or ())  # type: ignore[index, union-attr]
        usage = r.usage_metadata
    thoughts = [p.text for p in parts if p.thought]
    answer = [p.text for p in parts if not p.thought]
    assert thoughts and answer and parts[0].thought  # the thoughts first
    assert usage is not None and usage.thoughts_token_count and usage.candidates_token_count
    assert usage.total_token_count == (usage.prompt_token_count or 0) + usage.candidates_token_count \
        + usage.thoughts_token_count


# -- hostile bytes on the new paths ---------------------------------------------------------------------

def _door_error(door: str, status: int, body: bytes) -> None:
    """The door's own error shape, with the contract's code inside."""
    doc = json.loads(body)
    if door == "anthropic":
        assert doc["type"] == "error" and set(doc["error"]) >= {"type", "message", "code"}, doc
    elif door == "responses":  # OpenAI's shape, the contract's own
        assert set(doc["error"]) >= {"type", "message", "code", "param"}, doc
    else:
        err = doc["error"]
        assert err["code"] == status and err["status"] and err["details"][0]["reason"], doc


HOSTILE_BODIES = st.one_of(
    st.binary(max_size=200), st.just(b""), st.just(b"[" * 2000),
    json_values := st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                                | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                                | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10
                                ).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model": st.text(max_size=8), "messages": json_values.map(json.loads)},
                          optional={"contents": json_values.map(json.loads),
                                    "generateContentRequest": json_values.map(json.loads),
                                    "safetySettings": json_values.map(json.loads),
                                    "service_tier": json_values.map(json.loads),
                                    # the Responses door's
                                    "input": json_values.map(json.loads), "tools": json_values.map(json.loads),
                                    "text": json_values.map(json.loads), "reasoning": json_values.map(json.loads)}
                          ).map(lambda d: json.dumps(d).encode()))
NEW_PATHS = [("anthropic", "POST", "/v1/messages/count_tokens", "x-api-key"),
             ("gemini", "POST", "/v1beta/models/chat-default:countTokens", "x-goog-api-key"),
             ("gemini", "POST", "/v1/models/chat-default:countTokens", "x-goog-api-key"),
             ("gemini", "POST", "/v1/models/chat-default:generateContent", "x-goog-api-key"),
             ("gemini", "POST", "/v1alpha/models/chat-gemini:generateContent", "x-goog-api-key"),
             ("responses", "POST", "/v1/responses", "authorization")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(where=st.sampled_from(NEW_PATHS), data=HOSTILE_BODIES)
def test_hostile_bytes_on_the_new_paths_get_the_doors_4xx(up: Stack, where: tuple[str, str, str, str],
                                                          data: bytes) -> None:
    """Token counts, the Gemini door's other versions, a door's own fields: whatever arrives there is
    served or refused in the door's shape with a 4xx - never a 5xx, never a traceback."""
    from tests.helpers import request
    door, method, path, key_header = where
    key = f"Bearer {KEY}" if key_header == "authorization" else KEY
    r = request(f"{up.url}{path}", method, data, {key_header: key}, timeout=20)
    assert r.status < 500, (r.status, r.body[:300])
    if r.status >= 400:
        _door_error(door, r.status, r.body)


@pytest.mark.parametrize("path", ["/v1beta/models/%00", "/v1beta/models/" + "x" * 3000, "/v1alpha/models/a%2Fb",
                                  "/v1beta/models/chat-default/", "/v1beta/models?pageSize=-1"])
def test_hostile_model_lookups_get_the_doors_answer(up: Stack, path: str) -> None:
    from tests.helpers import request
    r = request(f"{up.url}{path}", "GET", None, {"x-goog-api-key": KEY})
    assert r.status < 500, (r.status, r.body[:300])
    if r.status >= 400:
        _door_error("gemini", r.status, r.body)


# -- the Responses API: what Codex and the Agents SDK read besides the matrix ---------------------------

def test_a_responses_stream_is_the_event_sequence_codex_reads(up: Stack) -> None:
    from tests.helpers import request
    r = request(f"{up.url}/v1/responses", "POST", {"model": "chat-default", "max_output_tokens": 3, "stream": True,
                                                   "input": "raw"}, {"authorization": f"Bearer {KEY}"})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [(e.split("\n", 1)[0].removeprefix("event: "), json.loads(e.split("\n", 1)[1].removeprefix("data: ")))
              for e in r.body.decode().split("\n\n") if e]
    assert [kind for kind, _ in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert all(data["type"] == kind for kind, data in events)
    final = events[-1][1]["response"]
    assert final["usage"]["output_tokens"] == 3 and final["output"][0]["type"] == "message"
    assert b"[DONE]" not in r.body and b"chat.completion" not in r.body


def test_an_agent_s_tool_loop_is_metered_turn_by_turn(up: Stack) -> None:
    """Each turn of a Responses tool loop is one request with one ledger entry: the usage the SDK read,
    the deployment that answered."""
    client = openai_client(up)
    fn: Any = [{"type": "function", "name": "search_docs", "parameters": SCHEMA, "strict": False}]
    raw = client.responses.with_raw_response.create(model="chat-anthropic", max_output_tokens=120, tools=fn,
                                                    input="use search_docs", tool_choice="required")
    first = raw.parse()
    (call,) = [o for o in first.output if o.type == "function_call"]
    items: list[Any] = ["use search_docs", *first.output]
    items[0] = {"role": "user", "content": items[0]}
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "found it"})
    raw2 = client.responses.with_raw_response.create(model="chat-anthropic", max_output_tokens=40, tools=fn,
                                                     input=[i if isinstance(i, dict) else i.model_dump(
                                                         exclude_none=True) for i in items])
    second = raw2.parse()
    assert second.output_text
    for r, resp in ((raw, first), (raw2, second)):
        entry = ledger_of(up, r.headers["x-request-id"], "acme")
        assert resp.usage is not None and entry["usage"]["completion_tokens"] == resp.usage.output_tokens
        assert entry["attempts"][-1]["deployment"] == "demo-anthropic" and entry["settlement"] == "actual"


@pytest.mark.parametrize("kw, param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
])
def test_what_the_stateless_responses_door_does_not_serve_is_refused_by_name(up: Stack, kw: dict[str, Any],
                                                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(up).responses.create(model="chat-default", max_output_tokens=3, input="x", **kw)
    assert e.value.code == "unsupported_field" and e.value.param == param


@pytest.mark.parametrize("route", ["chat-default", "chat-anthropic"])
def test_codex_s_tools_a_namespace_and_a_built_in_search(up: Stack, route: str) -> None:
    """Codex's tools as it sends them, to a pool and a provider: a call to a function of its
    `multi_agent_v1` namespace comes back named in its namespace (JSON and stream), and `web_search`,
    which no upstream here hosts, is dropped and reported - never a refusal."""
    spawn = {"type": "function", "name": "spawn_agent", "parameters": {
        "type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}
    tools: Any = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
                  {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [spawn]},
                  {"type": "web_search"}]
    codex = {"User-Agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.171.0)"}
    client = openai_client(up).with_options(default_headers=codex)
    ask = "start multi_agent_v1__spawn_agent"  # (the simulated model calls the tools a turn names)
    raw = client.responses.with_raw_response.create(model=route, max_output_tokens=60, input=ask, tools=tools)
    (call,) = [i for i in raw.parse().output if i.type == "function_call"]
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1"), call
    assert "tools.2 (unsupported" in raw.headers["x-llmgw-translation-loss"], dict(raw.headers)
    entry = ledger_of(up, raw.headers["x-request-id"], "acme")
    assert any(x.startswith("tools.2 (unsupported") for x in entry["attempts"][-1]["translation_loss"]), entry
    events = list(client.responses.create(model=route, max_output_tokens=60, input=ask, tools=tools, stream=True))
    (done,) = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert (done.name, done.namespace) == ("spawn_agent", "multi_agent_v1")
    # The call goes back as Codex sends it: named in its namespace.
    back = client.responses.create(model=route, max_output_tokens=400, tools=tools, input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "started"}])
    assert back.status == "completed" and back.output_text


@pytest.mark.parametrize("route", ["chat-anthropic", "chat-bedrock", "chat-gemini"])
def test_a_request_the_size_of_claude_code_s_first_fits_every_hosted_route(up: Stack, route: str) -> None:
    """The demo's hosted deployments have their providers' windows (200k tokens for the Anthropic- and
    Bedrock-shaped, about a million for the Gemini-shaped): Claude Code's first request (~22k tokens of
    system prompt and tools, `max_tokens: 32000`) is served, not refused for its size."""
    system = "You are a coding agent. Follow the repository's conventions. " * 2_000  # ~22k tokens
    with anthropic_client(up).messages.stream(model=route, max_tokens=32_000, system=system, messages=ask("hi"),
                                              stop_sequences=["."]) as s:  # (streamed, as Claude Code asks)
        m = s.get_final_message()
    assert m.content and m.usage.input_tokens > 15_000, m.usage


@pytest.mark.parametrize("door, route, body, field", [
    # refused at intake, before anything is reserved
    ("responses", "chat-default", {"input": "x", "store": True}, "store"),
    ("gemini", "chat-gemini", {"contents": [{"role": "user", "parts": [{"text": "x"}]}],
                               "generationConfig": {"logprobs": 3}}, "generationConfig.logprobs"),
    # refused by the route after the budget stage reserved: released, and the entry still names it
    # (Converse takes a schema only as a tool's input: an object)
    ("responses", "chat-bedrock", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "A", "schema": {"type": "array", "items": {"type": "string"}}}}},
     "text.format"),
    ("anthropic", "chat-bedrock", {"messages": ask("x"), "tools": [{"name": "search_docs", "input_schema": SCHEMA}],
                                   "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use"),
])
def test_a_refusal_s_ledger_entry_names_the_field(up: Stack, door: str, route: str, body: dict[str, Any],
                                                  field: str) -> None:
    from tests.helpers import request
    if door == "gemini":  # the route is in the path
        r = request(f"{up.url}/v1beta/models/{route}:generateContent", "POST", body, {"x-goog-api-key": KEY})
    else:
        path = {"responses": "/v1/responses", "anthropic": "/v1/messages"}[door]
        r = request(f"{up.url}{path}", "POST", {"model": route, "max_tokens" if door == "anthropic" else
                                                "max_output_tokens": 5, **body}, {"authorization": f"Bearer {KEY}"})
    assert r.status == 400, r.body
    entry = ledger_of(up, r.headers["x-request-id"], "acme")
    assert entry["error"] == "unsupported_field" and entry["field"] == field, entry
    assert entry["route"] == route  # the route it asked for, refused at intake or by the route
