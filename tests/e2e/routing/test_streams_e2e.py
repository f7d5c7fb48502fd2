"""The stream guard, through the real processes: whole events, the gateway's own usage chunk withheld,
failures after the first byte ended with `stream_interrupted`, and each stream settled."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import openai
import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS
from tests.conftest import ledger_of as conftest_ledger_of
from tests.e2e.routing.test_e2e_served_path import engine_log
from tests.helpers import chat_body, inject_fault, request, stream_raw, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["globex"]  # public data: nothing redacted, so the engine log shows the prompt as sent


def ledger_of(stack: Stack, rid: str) -> dict[str, Any]:
    return conftest_ledger_of(stack, rid, "globex")


def events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.startswith("data: ")]


# Streams are guarded in Envoy (Lua); with an Idempotency-Key, by ext_proc (recorded for replay).
GUARDS = pytest.mark.parametrize("idempotent", [False, True], ids=["lua-guard", "extproc-guard"])


def idempotency(idempotent: bool) -> dict[str, str]:
    return {"idempotency-key": f"k-{time.time_ns()}"} if idempotent else {}


@GUARDS
def test_usage_the_client_did_not_ask_for_is_metered_and_withheld(stack: Stack, idempotent: bool) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    marker = unique_marker("withhold")
    with client.chat.completions.with_streaming_response.create(
            model="chat-default", max_tokens=6, stream=True, extra_headers=idempotency(idempotent),
            messages=[{"role": "user", "content": marker}]) as resp:
        rid = resp.headers["x-request-id"]
        chunks = list(resp.parse())
    assert chunks and all(c.choices for c in chunks)  # no usage chunk: the client did not ask
    assert all(c.usage is None for c in chunks)
    (sent,) = [e for e in engine_log(stack) if marker in json.dumps(e["messages"])]
    assert sent["stream_options"] == {"include_usage": True}  # the gateway asked on its behalf
    entry = ledger_of(stack, rid)
    assert entry["settlement"] == "actual" and entry["usage_source"] == "reported"
    # The first byte's time, from arrival at Envoy: a positive figure within the request's life.
    assert 0 < entry["attempts"][-1]["first_byte_ms"] < 10_000
    assert entry["usage"]["completion_tokens"] == len([c for c in chunks if c.choices[0].delta.content])


def test_usage_the_client_asked_for_reaches_it(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    chunks = list(client.chat.completions.create(model="chat-default", max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "usage please"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


@GUARDS
def test_a_client_that_hangs_up_right_after_done_got_the_whole_stream(stack: Stack, idempotent: bool) -> None:
    """The engine ends its answer 600 ms after [DONE] and the client hangs up on [DONE] (as the SDKs
    do): Envoy reports the client gone, yet the client had everything - settled as complete, at the
    reported usage, and an idempotent one kept for replay (found in a CI run: it was client_cancel)."""
    marker = inject_fault(stack.engine_urls(), "end_delay_ms=600")
    key = idempotency(idempotent)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)

    def stream() -> tuple[str, str]:
        with client.chat.completions.with_streaming_response.create(
                model="chat-default", max_tokens=5, stream=True, extra_headers=key,
                messages=[{"role": "user", "content": marker}]) as resp:
            return resp.headers["x-request-id"], "".join(c.choices[0].delta.content or ""
                                                          for c in resp.parse() if c.choices)
    rid, text = stream()
    entry = ledger_of(stack, rid)
    assert (entry["termination"], entry["settlement"], entry["usage_source"]) == ("complete", "actual", "reported")
    assert entry["usage"]["completion_tokens"] == 5
    if idempotent:  # the repeat is the recorded answer, not a second run
        assert stream()[1] == text
        assert len([e for e in engine_log(stack) if marker in json.dumps(e["messages"])]) == 1


def stream_until_cut(stack: Stack, fault: str, idempotent: bool = False) -> tuple[str, bytes]:
    """(request id, what arrived) of a stream that may be cut: a reset is what the client then sees."""
    marker = inject_fault(stack.engine_urls(), fault)
    _, rid, got = stream_raw(f"{stack.url}/v1/chat/completions", chat_body(content=marker, max_tokens=20, stream=True),
                             {"authorization": f"Bearer {KEY}", **idempotency(idempotent)}, timeout=10)
    return rid, got


@GUARDS
@pytest.mark.parametrize("fault", ["malformed_after=3", "disconnect_after=3"])
def test_a_failure_after_the_first_byte_is_stream_interrupted(stack: Stack, fault: str, idempotent: bool) -> None:
    rid, raw = stream_until_cut(stack, fault, idempotent)
    got = events(raw)
    assert "[DONE]" not in got  # never a normal finish
    if fault.startswith("malformed"):  # the stream still flows: the guard ends it with the contract's event
        last = json.loads(got[-1])
        assert last["error"]["code"] == "stream_interrupted", last
        assert all("error" not in json.loads(e) for e in got[:-1])  # the broken event never reached the client
    # A cut connection reaches the client as a reset (Envoy cannot add an event to a reset stream, and
    # drops the chunks still waiting on the guard).
    entry = ledger_of(stack, rid)
    assert entry["termination"] == "stream_interrupted"
    # The guard settles what it saw; a stream cut before the guard saw it settles from the access log,
    # its usage unknown: charged in full (ambiguous), never freed.
    assert entry["settlement"] in (("partial",) if fault.startswith("malformed") else ("partial", "ambiguous"))


def extproc_messages(stack: Stack) -> Counter[str]:
    """ext_proc messages received so far, by role, summed over the workers (their own counters)."""
    total: Counter[str] = Counter()
    for url in stack.status_urls:
        total.update(request(url).json()["extproc_messages"])
    return total


def test_a_long_stream_costs_ext_proc_a_constant_number_of_messages(stack: Stack) -> None:
    """Per chunk, a stream passes Envoy's native filters only: 256 tokens, one event each, cost the
    decision's one message and nothing per chunk (the Lua stream guard withholds the usage chunk and
    hands its numbers to the access log, which settles)."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    before = extproc_messages(stack)
    with client.chat.completions.with_streaming_response.create(
            model="chat-default", max_tokens=256, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": unique_marker("long")}]) as resp:
        rid = resp.headers["x-request-id"]
        chunks = list(resp.parse())
    tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(tokens) == 256 and all(c.usage is None for c in chunks)
    entry = ledger_of(stack, rid)
    assert entry["settlement"] == "actual" and entry["usage"]["completion_tokens"] == 256
    spent = extproc_messages(stack) - before
    assert spent == Counter({"decision": 1}), spent
