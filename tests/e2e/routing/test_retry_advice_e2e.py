"""Retries belong to the gateway. The openai and anthropic SDKs retry 408, 409, 429 and every 5xx twice
by default, and each retry is generated and charged again. So every error says whether a client's
retry can change it (`x-should-retry`, which both SDKs obey before their own rules): an upstream's
failure after the gateway's own retries is final, and so the engine receives no more attempts than the
route allows, whichever SDK asked at its defaults. google-genai retries nothing unless told to.

The control: the same request with the header taken off the answer before the SDK reads it (an httpx
response hook) - what the SDKs did before the gateway sent it - reaches the engine three times."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from extproc.contract import SHOULD_RETRY_HEADER
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, start_stack
from tests.helpers import clear_faults, inject_fault, request, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
ROUTE = "chat-default"  # the pool; its route retries connection failures only, so an engine's 503 is final


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("retry-advice"))
    yield s
    s.stop()


def arrivals(gw: Stack, marker: str) -> int:
    """Requests holding `marker` that reached any of the pool's engines."""
    return sum(marker in json.dumps(r.get("messages")) for url in gw.engine_urls("engine-pool")
               for r in request(f"{url}/admin/requests").json())


def failing(gw: Stack) -> str:
    """A marker whose requests every engine answers 503, as often as they come."""
    return inject_fault(gw.engine_urls("engine-pool"), "status=503", count=50, marker=unique_marker("RETRY"))


def stripped(sdk: Any) -> Any:
    """The SDK's own HTTP client, dropping the gateway's advice before the SDK reads the answer."""
    def drop(response: Any) -> None:
        response.headers.pop(SHOULD_RETRY_HEADER, None)
    return sdk.DefaultHttpxClient(event_hooks={"response": [drop]})


def openai_call(gw: Stack, marker: str, **client: Any) -> openai.APIStatusError:
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, **client)  # max_retries: the SDK's default (2)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=ROUTE, max_tokens=8, messages=[{"role": "user", "content": marker}])
    return e.value


def anthropic_call(gw: Stack, marker: str, **client: Any) -> anthropic.APIStatusError:
    c = anthropic.Anthropic(base_url=gw.url, api_key=KEY, **client)
    with pytest.raises(anthropic.APIStatusError) as e:
        c.messages.create(model=ROUTE, max_tokens=8, messages=[{"role": "user", "content": marker}])
    return e.value


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_an_sdk_at_its_defaults_sends_a_failed_request_once(gw: Stack, sdk: str) -> None:
    call, module = (openai_call, openai) if sdk == "openai" else (anthropic_call, anthropic)
    marker = failing(gw)
    try:
        err = call(gw, marker)
        assert err.status_code == 502 and err.response.headers[SHOULD_RETRY_HEADER] == "false"
        assert "retry-after" not in err.response.headers
        time.sleep(0.2)
        assert arrivals(gw, marker) == 1  # the route allows one attempt for an engine's 503
        # Without the advice the SDK decides by the status alone: 502 is retried, twice.
        control = failing(gw)
        err = call(gw, control, http_client=stripped(module))
        assert err.status_code == 502
        time.sleep(0.2)
        assert arrivals(gw, control) == 3
    finally:
        clear_faults(gw.engine_urls("engine-pool"))


def test_google_genai_at_its_defaults_sends_it_once(gw: Stack) -> None:
    marker = failing(gw)
    try:
        c = genai.Client(api_key=KEY, http_options=types.HttpOptions(base_url=gw.url))
        with pytest.raises(genai_errors.ServerError) as e:
            c.models.generate_content(model=ROUTE, contents=marker,
                                      config=types.GenerateContentConfig(max_output_tokens=8))
        assert e.value.code == 502
        time.sleep(0.2)
        assert arrivals(gw, marker) == 1
    finally:
        clear_faults(gw.engine_urls("engine-pool"))


def test_refusals_say_whether_to_come_back(gw: Stack) -> None:
    """A refusal that depends on the request is final; one that capacity decides says when to retry."""
    bad = request(f"{gw.url}/v1/chat/completions", "POST", {"model": ROUTE, "messages": [], "bogus": 1},
                  {"authorization": f"Bearer {KEY}"})
    assert bad.status == 400 and bad.headers[SHOULD_RETRY_HEADER] == "false"
    nobody = request(f"{gw.url}/v1/chat/completions", "POST", {"model": ROUTE, "messages": []},
                     {"authorization": "Bearer sk-llmgw-nobody"})
    assert nobody.status == 401 and nobody.headers[SHOULD_RETRY_HEADER] == "false"
    # ext_proc gone: Envoy's own 503 says to come back in a second.
    for worker in gw.extprocs:
        worker.stop()
    try:
        down = request(f"{gw.url}/v1/chat/completions", "POST",
                       {"model": ROUTE, "messages": [{"role": "user", "content": "hi"}]},
                       {"authorization": f"Bearer {KEY}"})
        assert down.status == 503, down.body
        assert (down.headers[SHOULD_RETRY_HEADER], down.headers["retry-after"]) == ("true", "1")
    finally:
        for worker in gw.extprocs:
            worker.start()
