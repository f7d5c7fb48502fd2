"""POST /v1/embeddings through the real Envoy with the openai SDK as its users write it (its default
asks for base64 and decodes it): the same identity, policy, reservation (the inputs' tokens, nothing
generated), redaction, routing to a pooling engine that qualified on the embeddings corpus, ledger
and trace as a chat completion; and every refusal in OpenAI's shape, naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of
from tests.helpers import request

pytestmark = pytest.mark.e2e
ROUTE = "embed-default"
PRICE = 20000  # micro-USD per million input tokens (policy/deployments/pool-embed.yaml)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)


def engine_log(stack: Stack, marker: str) -> list[dict[str, Any]]:
    return [e for url in stack.engine_urls("embed-pool") for e in request(f"{url}/admin/requests").json()
            if marker in json.dumps(e.get("messages"))]


def test_an_embeddings_request_is_metered_and_recorded_like_a_chat_completion(stack: Stack) -> None:
    raw = client(stack).embeddings.with_raw_response.create(model=ROUTE, input=["first text", "second, longer text"])
    r = raw.parse()
    assert [d.index for d in r.data] == [0, 1]
    assert len({len(d.embedding) for d in r.data}) == 1 and len(r.data[0].embedding) > 1
    assert all(abs(math.sqrt(sum(x * x for x in d.embedding)) - 1) < 1e-5 for d in r.data)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    entry = ledger_of(stack, raw.headers["x-request-id"], "acme")
    assert entry["operation"] == "embeddings" and entry["route"] == ROUTE and entry["settlement"] == "actual"
    assert entry["usage"]["prompt_tokens"] == r.usage.prompt_tokens and entry["usage"]["completion_tokens"] == 0
    # The reservation held the inputs' bound and nothing to generate; the charge is the inputs' tokens.
    assert entry["max_tokens"] == 0 and entry["reserved_tokens"] == entry["prompt_bound"] >= r.usage.prompt_tokens
    assert entry["charged_tokens"] == r.usage.prompt_tokens
    assert entry["charged_micros"] == math.ceil(r.usage.prompt_tokens * PRICE / 1e6)
    assert entry["attempts"][0]["deployment"] == "pool-embed"


def test_the_same_text_embeds_the_same_in_either_encoding(stack: Stack) -> None:
    c = client(stack)
    b64 = c.embeddings.create(model=ROUTE, input="a stable text").data[0].embedding
    floats = c.embeddings.create(model=ROUTE, input="a stable text", encoding_format="float").data[0].embedding
    assert [round(x, 5) for x in b64] == [round(x, 5) for x in floats]
    other = c.embeddings.create(model=ROUTE, input="something else entirely").data[0].embedding
    assert other != b64


def test_inputs_are_redacted_before_the_engine_sees_them(stack: Stack) -> None:
    raw = client(stack).embeddings.with_raw_response.create(
        model=ROUTE, input=["embed-redact-41 write to jane.doe@example.com", "plain"])
    (seen,) = engine_log(stack, "embed-redact-41")
    assert "jane.doe@example.com" not in json.dumps(seen) and "[EMAIL_1]" in seen["messages"][0]
    assert seen["messages"][1] == "plain"  # every input, in order
    assert ledger_of(stack, raw.headers["x-request-id"], "acme")["redactions"] == "email=1"


@pytest.mark.parametrize("kw, code, param", [
    ({"dimensions": 8}, "unsupported_field", "dimensions"),
    ({"input": [[1, 2, 3]]}, "unsupported_field", "input[0]"),
    ({"input": []}, "invalid_request", "input"),
    ({"input": ""}, "invalid_request", "input[0]"),
    ({"input": "word " * 40000}, "context_length_exceeded", "input"),
    ({"model": "chat-default"}, "invalid_request", "model"),  # a chat route takes no embeddings request
    ({"model": "no-such-route"}, "route_not_found", "model"),
])
def test_a_refusal_is_openais_shape_naming_the_field(stack: Stack, kw: dict[str, Any], code: str, param: str) -> None:
    args: dict[str, Any] = {"model": ROUTE, "input": "x", **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client(stack).embeddings.create(**args)
    assert e.value.status_code in (400, 404)
    body: Any = e.value.body
    assert body["code"] == code and body["param"] == param, body


def test_an_embeddings_route_takes_no_chat_completion_from_any_door(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(stack).chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": "x"}])
    assert "POST /v1/embeddings" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as a:
        anthropic.Anthropic(base_url=stack.url, api_key=DEMO_KEYS["acme"], max_retries=0).messages.create(
            model=ROUTE, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert a.value.body["error"]["param"] == "model"  # type: ignore[index]


def test_an_embeddings_request_without_a_key_learns_nothing(stack: Stack) -> None:
    r = request(f"{stack.url}/v1/embeddings", "POST", {"model": ROUTE, "input": "x"})
    assert r.status == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = request(f"{stack.url}/v1/embeddings", "POST", None, {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    assert r.status == 400  # Envoy's own answer: no body reached ext_proc


def test_what_redaction_adds_stays_within_the_reservation(stack: Stack) -> None:
    """A placeholder can be longer than the value it replaces ("1.2.3.4" -> "[IP_ADDRESS_1]"). A chat
    completion takes the growth from its completion tokens; an embeddings request reserves room for
    it per input and, past that room, is refused before any engine is charged (invariant 3)."""
    one = client(stack).embeddings.with_raw_response.create(model=ROUTE, input="the host at 10.1.2.3 answers")
    entry = ledger_of(stack, one.headers["x-request-id"], "acme")
    assert entry["redactions"] == "ip_address=1" and entry["charged_tokens"] <= entry["reserved_tokens"]
    many = " ".join(f"10.0.0.{i}" for i in range(40))
    with pytest.raises(openai.BadRequestError) as e:
        client(stack).embeddings.create(model=ROUTE, input=many)
    body: Any = e.value.body
    assert body["param"] == "input" and "reservation" in body["message"], body


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=10)
HOSTILE = st.one_of(
    st.binary(max_size=200), st.just(b""), st.just(b"[" * 2000), _JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model": st.sampled_from([ROUTE, "chat-default"]) | st.text(max_size=8)},
                          optional={"input": _JSON, "encoding_format": _JSON, "user": _JSON, "dimensions": _JSON,
                                    "messages": _JSON}).map(lambda d: json.dumps(d).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=HOSTILE)
def test_hostile_bytes_get_a_contract_4xx(stack: Stack, data: bytes) -> None:
    """Whatever arrives on POST /v1/embeddings is served or refused in the contract's shape with a 4xx:
    never a 5xx, never a traceback."""
    r = request(f"{stack.url}/v1/embeddings", "POST", data, {"authorization": f"Bearer {DEMO_KEYS['acme']}"},
                timeout=20)
    assert r.status < 500, (r.status, r.body[:300])
    if r.status >= 400:
        doc = r.json()
        assert set(doc) == {"error"} and doc["error"]["code"] and isinstance(doc["error"]["message"], str), doc
