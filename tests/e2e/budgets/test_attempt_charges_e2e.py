"""Every attempt that was sent is settled (invariant 23): on a route that retries after an attempt
sent and never answered (`no_first_byte`), each such attempt may have run to completion upstream, so
it is charged at its bound as `unknown` and listed in the request's one ledger entry; an attempt that
answered an error, or never reached an upstream, is listed and charged nothing. The reservation holds
every bound the attempts may be charged, so the total never passes it. The clients are the openai SDK
at its defaults; the engines' own request logs show what reached them."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, stamp_evidence
from tests.helpers import clear_faults, inject_fault, request

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
RETRIES = 2


def retrying_policy(tmp: Path) -> Path:
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["retry"] = {"attempts": RETRIES, "eligible_failures": ["connect_before_send", "unavailable", "no_first_byte"],
                      "requires": "read_only_or_idempotency_key"}
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    stamp_evidence(policy, "pool-llama-8b")  # under the route's new retry policy
    return policy


gw = module_stack("attempt-charges", retrying_policy, workers=2)


@pytest.fixture(autouse=True)
def no_faults_left(gw: Stack) -> Any:
    yield
    for url in gw.engine_urls():
        with contextlib.suppress(OSError):  # (the last test stops one)
            clear_faults([url])


def received(stack: Stack, marker: str) -> list[dict[str, Any]]:
    """What the pool's engines logged of the requests holding this marker, in arrival order."""
    seen = [e for u in stack.engine_urls("engine-pool") for e in request(f"{u}/admin/requests").json()
            if marker in json.dumps(e["messages"])]
    return sorted(seen, key=lambda e: e.get("time", 0))


def answer_charge(entry: dict[str, Any]) -> int:
    """What the answering attempt's usage costs, from the entry's own priced lines."""
    return math.ceil(sum(line["tokens"] * line["per_mtok"] for line in entry["charge_lines"]) / 1e6)


def rate(entry: dict[str, Any], token_class: str) -> int:
    return next(line["per_mtok"] for line in entry["charge_lines"] if line["class"] == token_class)


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY)  # the SDK's default retries


def test_each_stream_attempt_without_a_first_byte_is_charged_its_prompt_bound(gw: Stack) -> None:
    # Both engines of the pool hold their next answer past the attempt's share of the deadline (1.5 s
    # over three attempts): attempts 1 and 2 time out before a byte, attempt 3 answers.
    marker = inject_fault(gw.engine_urls("engine-pool"), "delay_ms=3000")
    raw = client(gw).chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"slow start {marker}"}],
        extra_headers={"x-llmgw-deadline-ms": "1500"})
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text and raw.headers["x-llmgw-attempts"] == "3"
    assert len(received(gw, marker)) == 3  # every attempt reached an engine
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    first, second, answer = entry["attempts"]
    for n, attempt in ((1, first), (2, second)):
        assert (attempt["n"], attempt["status"], attempt["settlement"], attempt["logged"]) == (n, 0, "unknown", True)
        assert "UT" in attempt["flags"]  # its limit passed before the first byte
        # A stream generates nothing before its first byte: the prompt's bound, at its price.
        assert attempt["charged_tokens"] == entry["prompt_bound"]
        assert attempt["charged_micros"] == math.ceil(entry["prompt_bound"] * rate(entry, "input") / 1e6)
    assert (answer["n"], answer["status"]) == (3, 200)
    assert entry["charged_micros"] == answer_charge(entry) + first["charged_micros"] + second["charged_micros"]
    assert entry["charged_tokens"] == (entry["usage"]["prompt_tokens"] + entry["usage"]["completion_tokens"]
                                       + 2 * entry["prompt_bound"])
    # The reservation held one answer's bound and each retry's prompt bound: the charge fits it.
    bound = (math.ceil(entry["prompt_bound"] * rate(entry, "input") / 1e6)
             + math.ceil(entry["max_tokens"] * rate(entry, "output") / 1e6))
    assert entry["reserved_micros"] == bound + RETRIES * first["charged_micros"]
    assert entry["charged_micros"] <= entry["reserved_micros"]


def test_a_json_answer_lost_before_its_headers_is_charged_its_whole_bound(gw: Stack) -> None:
    # The engine generates the answer whole, then its connection drops before the headers: the work
    # was done and the client cannot know it. Envoy retries (a reset) and the next attempt answers.
    marker = inject_fault(gw.engine_urls("engine-pool"), "disconnect_after=0")
    raw = client(gw).chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=4, messages=[{"role": "user", "content": f"lost answer {marker}"}])
    assert raw.parse().choices[0].message.content
    attempts = int(raw.headers["x-llmgw-attempts"])
    assert attempts >= 2
    logged = received(gw, marker)
    assert len(logged) == attempts and all(e.get("output_tokens") for e in logged)  # each lost one ran whole
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    *lost, answer = entry["attempts"]
    assert answer["status"] == 200 and len(lost) == attempts - 1
    each = entry["reserved_micros"] // (RETRIES + 1)  # a JSON answer's retries each hold a whole bound
    assert entry["reserved_micros"] == each * (RETRIES + 1)
    for attempt in lost:
        assert (attempt["status"], attempt["settlement"], attempt["charged_micros"]) == (0, "unknown", each), attempt
        assert attempt["charged_tokens"] == entry["prompt_bound"] + entry["max_tokens"]
    assert entry["charged_micros"] == answer_charge(entry) + each * len(lost)


def test_an_attempt_answered_with_an_error_is_listed_and_charged_nothing(gw: Stack) -> None:
    marker = inject_fault(gw.engine_urls("engine-pool"), "status=503")
    raw = client(gw).chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=4, messages=[{"role": "user", "content": f"refused once {marker}"}])
    assert raw.parse().choices[0].message.content
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    *refused, answer = entry["attempts"]
    assert refused and answer["status"] == 200
    for attempt in refused:
        assert (attempt["status"], attempt["settlement"], attempt["charged_micros"]) == (503, "released", 0), attempt
    assert entry["charged_micros"] == answer_charge(entry)


def test_the_response_filter_that_settles_an_idempotent_stream_charges_its_unanswered_attempts(gw: Stack) -> None:
    """An idempotent stream is settled by its own filter, which never sees the attempt log: the
    attempts before the answer that may have run are charged at their bound all the same."""
    marker = inject_fault(gw.engine_urls("engine-pool"), "delay_ms=3000")
    raw = client(gw).chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"kept stream {marker}"}],
        extra_headers={"x-llmgw-deadline-ms": "1500", "idempotency-key": f"kept-{time.time_ns()}"})
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
    *earlier, answer = entry["attempts"]
    assert [(a["n"], a["settlement"], a["charged_tokens"]) for a in earlier] == [
        (1, "unknown", entry["prompt_bound"]), (2, "unknown", entry["prompt_bound"])]
    assert answer["n"] == 3 and answer["status"] == 200
    assert entry["charged_micros"] == answer_charge(entry) + sum(a["charged_micros"] for a in earlier)


def test_an_attempt_that_never_reached_an_engine_is_charged_nothing(gw: Stack) -> None:
    """One engine of the pool stops: until Envoy's health checks take it out, an attempt sent its way
    meets a refused connection and is retried on the other. It ran nothing: listed, charged 0."""
    down = gw.engine_urls("engine-pool")[0]
    child = next(c for addr, c in gw.engines.items() if down.endswith(addr))
    child.stop()
    entry: dict[str, Any] = {}
    deadline = time.time() + 15
    while time.time() < deadline:
        raw = client(gw).chat.completions.with_raw_response.create(
            model="chat-default", max_tokens=4, messages=[{"role": "user", "content": "is anyone there"}])
        if raw.headers["x-llmgw-attempts"] != "1":
            entry = ledger_of(gw, raw.headers["x-request-id"], "acme")
            break
    assert entry, "no request met the stopped engine before the health checks took it out"
    *refused, answer = entry["attempts"]
    assert answer["status"] == 200
    for attempt in refused:
        assert (attempt["status"], attempt["settlement"], attempt["charged_micros"]) == (0, "released", 0), attempt
        assert "UF" in attempt["flags"]
    assert entry["charged_micros"] == answer_charge(entry)
