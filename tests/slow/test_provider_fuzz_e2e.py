"""Hostile provider answers through the real gateway (issue 13, bad input and faults): providers of
each translated shape answer 200 with random bytes - as a JSON body or as a stream - and the client
gets 502 `upstream_error` before the first byte, or a stream that ends with `stream_interrupted` and
never a normal finish; every request has its ledger entry, and ext_proc logs no traceback."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.bench.translated import add_anthropic_route, add_provider_route, simulated_provider
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import chat_body, inject_fault, request, stream_raw

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
SEEDS = range(12)
OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    anthropic, a_url = simulated_provider("anthropic", "claude-sim-1", "sk-fuzz-a", tmp / "a.log")
    gemini, g_url = simulated_provider("gemini", "gemini-sim-1", "sk-fuzz-g", tmp / "g.log")
    bedrock_key = "AKIDFUZZ000000000001:fuzz-secret"
    bedrock, b_url = simulated_provider("bedrock", "bedrock-sim-1", bedrock_key, tmp / "b.log")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    add_anthropic_route(policy, a_url.removeprefix("http://"), "sk-fuzz-a")
    add_provider_route(policy, "gemini-sim", "gemini@1", "gemini-api@v1beta", "gemini-sim-1",
                       g_url.removeprefix("http://"), "sk-fuzz-g", "chat-gemini")
    add_provider_route(policy, "bedrock-sim", "bedrock@1", "bedrock-converse@2023-09-30", "bedrock-sim-1",
                       b_url.removeprefix("http://"), bedrock_key, "chat-bedrock", options={"region": "eu-central-1"})
    s = start_stack(tmp / "state", policy)
    yield s, {"chat-anthropic": a_url, "chat-gemini": g_url, "chat-bedrock": b_url}
    s.stop()
    anthropic.stop()
    gemini.stop()
    bedrock.stop()


@pytest.mark.parametrize("route", ["chat-anthropic", "chat-gemini", "chat-bedrock"])
@pytest.mark.parametrize("stream", [False, True])
def test_random_bytes_from_a_provider_never_look_like_an_answer(gw: tuple[Stack, dict[str, str]], route: str,
                                                                stream: bool) -> None:
    stack, providers = gw
    for seed in SEEDS:
        marker = inject_fault([providers[route]], f"garbage={seed}", count=2)
        body = chat_body(route, content=marker, max_tokens=8, stream=stream)
        headers = {"authorization": f"Bearer {KEY}"}
        if not stream:
            r = request(f"{stack.url}/v1/chat/completions", "POST", body, headers)
            assert r.status == 502 and r.json()["error"]["code"] == "upstream_error", (seed, r.body[:200])
            rid = r.headers["x-request-id"]
            OUTCOMES["502"] += 1
            # The provider answered 200: what it was asked is charged in full, never released.
            assert ledger_of(stack, rid, "acme")["settlement"] == "ambiguous", seed
        else:
            status, rid, raw = stream_raw(f"{stack.url}/v1/chat/completions", body, headers, timeout=10)
            if status == 502:  # broken before anything was translated: nothing reached the client
                OUTCOMES["502"] += 1
            else:
                assert status == 200, (seed, raw[:200])
                events = [e for e in raw.decode("utf-8", "replace").split("\n\n") if e.strip()]
                assert "data: [DONE]" not in events, (seed, raw[-200:])  # never a normal finish
                last = json.loads(events[-1].removeprefix("data: "))
                assert last["error"]["code"] == "stream_interrupted", (seed, events[-1])
                OUTCOMES["interrupted"] += 1
        entry = ledger_of(stack, rid, "acme")  # every one recorded, once
        assert entry["termination"] in ("upstream_error", "stream_interrupted"), (seed, entry)


def test_the_fuzz_left_no_traceback(gw: tuple[Stack, dict[str, str]]) -> None:
    """Runs after the fuzz in this module: the ext_proc log holds no traceback, Envoy's no error of a
    Lua filter's script (the answer filter read every shape's answers and streams), and both outcomes
    were reached (a translated stream can break before or after its first byte)."""
    stack, _ = gw
    logs = {f.name: f.read_text(errors="replace") for f in Path(stack.logs).glob("extproc-*.log")}
    assert not [name for name, text in logs.items() if "Traceback" in text], logs
    envoy = (Path(stack.logs) / "envoy.log").read_text(errors="replace")
    assert not [line for line in envoy.splitlines() if "[lua]" in line], envoy[-2000:]
    routes = 3  # each with JSON and streams
    assert OUTCOMES["502"] >= len(SEEDS) * routes and sum(OUTCOMES.values()) == len(SEEDS) * routes * 2, OUTCOMES
