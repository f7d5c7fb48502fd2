"""Large answers through every path of the real gateway (issue 27, invariant 15): the simulator's
`bloat` fault makes an upstream answer 1, 4 or 16 MiB - a JSON body, or a stream whose events all come
in one write - through the pool, a lone translated candidate (the Lua answer filter), a fallback plan
(the attempt filter's composite), each front door to a hosted provider, and an idempotent request
(the meter). Envoy must stay up (Envoy 1.40 crashed on the attempt filter's path at about 1 MiB), and
every caller gets a complete answer in its own API's shape, or a clean error in that shape: never a
dropped connection."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.bench.translated import add_anthropic_route, add_route_of, simulated_provider
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import inject_fault, request, unique_marker

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
MIB = 1 << 20
ERRORS: list[tuple[str, int]] = []  # the JSON answers too large to carry, for the check below


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    tmp = tmp_path_factory.mktemp("large")
    provider, url = simulated_provider("anthropic", "claude-sim-1", "sk-large", tmp / "provider.log")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    ref = add_anthropic_route(policy, url.removeprefix("http://"), "sk-large")
    # A plan of two: the provider first, the pool after it (the attempt filter's composite cluster).
    add_route_of(policy, "chat-plan", ref, first=False)
    doc = yaml.safe_load((policy / "routes/chat-plan.yaml").read_text())
    doc["candidates"].reverse()
    (policy / "routes/chat-plan.yaml").write_text(yaml.safe_dump(doc))
    s = start_stack(tmp / "state", policy)
    yield s, url
    s.stop()
    provider.stop()


# (path, route, API shape of the caller, extra headers): each way an answer reaches a client.
PATHS = {
    "pool": ("/v1/chat/completions", "chat-default", "openai", {}),
    "translated": ("/v1/chat/completions", "chat-anthropic", "openai", {}),
    "plan": ("/v1/chat/completions", "chat-plan", "openai", {}),
    "idempotent": ("/v1/chat/completions", "chat-anthropic", "openai", {"idempotency-key": "large-"}),
    "anthropic_door": ("/v1/messages", "chat-anthropic", "anthropic", {}),
    "gemini_door": ("/v1beta/models/chat-anthropic:{method}", "chat-anthropic", "gemini", {}),
}


def _send(stack: Stack, path: str, shape: str, route: str, content: str, stream: bool,
          headers: dict[str, str]) -> tuple[int, bytes, str]:
    messages = [{"role": "user", "content": content}]
    if shape == "gemini":
        body: dict[str, Any] = {"contents": [{"role": "user", "parts": [{"text": content}]}],
                                "generationConfig": {"maxOutputTokens": 1024}}
        path = path.format(method="streamGenerateContent?alt=sse" if stream else "generateContent")
        auth = {"x-goog-api-key": KEY}
    elif shape == "anthropic":
        body = {"model": route, "max_tokens": 1024, "messages": messages, "stream": stream}
        auth = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    else:
        body = {"model": route, "max_tokens": 1024, "messages": messages, "stream": stream}
        auth = {"authorization": f"Bearer {KEY}"}
    r = request(f"{stack.url}{path}", "POST", body, {**auth, **headers}, timeout=120)
    return r.status, r.body, r.headers["x-request-id"]


def _complete_or_clean_error(shape: str, stream: bool, status: int, body: bytes, size: int) -> str:
    """'complete' (the whole answer, in the caller's shape) or 'error' (a clean one, in that shape)."""
    if status != 200:
        doc = json.loads(body)
        if shape == "anthropic":
            assert doc["type"] == "error" and doc["error"]["type"], doc
        elif shape == "gemini":
            assert isinstance(doc["error"]["code"], int) and doc["error"]["status"], doc
        else:
            assert doc["error"]["code"] == "upstream_error", doc
        assert status in (413, 502), (status, doc)
        return "error"
    text = body.decode()
    if not stream:
        doc = json.loads(text)
        written = {"openai": lambda: doc["choices"][0]["message"]["content"],
                   "anthropic": lambda: doc["content"][0]["text"],
                   "gemini": lambda: doc["candidates"][0]["content"]["parts"][0]["text"]}[shape]()
        assert len(written) >= size, (len(written), size)
        return "complete"
    events = [e for e in text.replace("\r\n", "\n").split("\n\n") if e.strip() and not e.startswith(":")]
    last = events[-1]
    if "stream_interrupted" in last or '"error"' in last:  # visible, in the caller's own shape
        return "error"
    if shape == "openai":
        assert last == "data: [DONE]", last[-300:]
    elif shape == "anthropic":
        assert last.startswith("event: message_stop"), last[-300:]
    else:
        assert '"finishReason"' in last, last[-300:]
    assert len(text) >= size, (len(text), size)
    return "complete"


@pytest.mark.parametrize("size", [1 * MIB, 4 * MIB, 16 * MIB], ids=["1MiB", "4MiB", "16MiB"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("way", list(PATHS))
def test_a_large_answer_never_takes_envoy_down(gw: tuple[Stack, str], way: str, stream: bool, size: int) -> None:
    stack, provider = gw
    path, route, shape, headers = PATHS[way]
    marker = unique_marker(f"large-{way}")
    upstream = stack.engine_urls("engine-pool") if route == "chat-default" else [provider]
    inject_fault(upstream, f"bloat={size}", count=1, marker=marker)
    headers = {k: v + marker for k, v in headers.items()}
    status, body, rid = _send(stack, path, shape, route, marker, stream, headers)
    outcome = _complete_or_clean_error(shape, stream, status, body, size)
    # 1 MiB fits every path whole; above the answer buffer a JSON answer that must be read (translated,
    # metered) is a clean 502, and a stream still flows.
    if size == MIB:
        assert outcome == "complete", (way, stream, status, body[-300:])
    if outcome == "error" and not stream:
        # The upstream answered 200 and did the work: charged in full, never released (item 3).
        assert ledger_of(stack, rid, "acme")["settlement"] == "ambiguous", (way, size)
        ERRORS.append((way, size))
    assert stack.envoy.proc.poll() is None, "Envoy died"
    log = (Path(stack.logs) / "envoy.log").read_text(errors="replace")
    assert "Caught Segmentation fault" not in log and "[lua]" not in log, log[-3000:]


def test_json_answers_over_the_answer_buffer_were_met(gw: tuple[Stack, str]) -> None:
    """Runs after the table above: the paths that read a JSON answer whole (translation, the meter)
    met answers too large for them, so the charge of such an answer was checked."""
    assert {way for way, size in ERRORS if size == 16 * MIB} >= {"translated", "plan", "idempotent"}, ERRORS


def test_a_pool_answer_too_large_for_envoy_is_charged_as_the_work_it_was(gw: tuple[Stack, str]) -> None:
    """The probe's case (issue 27, item 3): fields the gateway allows (docs/guide/clients.md) -
    ignore_eos, logprobs with 20 alternatives - make an engine's JSON answer larger than Envoy's answer
    buffer; the engine answered
    200 after generating it all, so the 502 the client gets is charged in full, not released."""
    stack, _ = gw
    body = {"model": "chat-default", "max_tokens": 4096, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": unique_marker("logprobs")}]}
    r = request(f"{stack.url}/v1/chat/completions", "POST", body, {"authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status == 502 and r.json()["error"]["code"] == "upstream_error", (r.status, r.body[:300])
    entry = ledger_of(stack, r.headers["x-request-id"], "acme")
    assert entry["settlement"] == "ambiguous" and entry["charged_micros"] == entry["reserved_micros"] > 0, entry


def test_a_pool_answer_whose_body_stalls_after_its_200_is_charged_as_the_work_it_was(
        gw: tuple[Stack, str]) -> None:
    """Item 3's other case: the engine answered 200 (its JSON answer generated before its headers),
    then its body stalled; Envoy's deadline ends it with 504. Charged in full, not released."""
    stack, _ = gw
    marker = unique_marker("stalled")
    inject_fault(stack.engine_urls(), "stall_after=20", count=1, marker=marker)
    r = request(f"{stack.url}/v1/chat/completions", "POST", {
        "model": "chat-default", "max_tokens": 16, "messages": [{"role": "user", "content": marker}]},
        {"authorization": f"Bearer {KEY}", "x-llmgw-deadline-ms": "1500"}, timeout=30)
    assert r.status == 504 and r.json()["error"]["code"] == "deadline_exceeded", (r.status, r.body[:300])
    entry = ledger_of(stack, r.headers["x-request-id"], "acme")
    assert entry["settlement"] == "ambiguous" and entry["charged_micros"] == entry["reserved_micros"] > 0, entry
