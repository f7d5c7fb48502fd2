"""A stream's limits after its first byte, through real Envoy and a simulated engine in real time:
silence longer than `envoy.stream_idle_timeout_ms` and a stream longer than the route's
`max_stream_ms` both end the stream without a normal finish, are recorded as stream_interrupted,
and stop the engine's generation."""

from __future__ import annotations

import http.client
import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, start_stack
from tests.e2e.routing.test_fallback_e2e import ledger_of
from tests.e2e.routing.test_streams_e2e import events
from tests.helpers import chat_body, inject_fault, request, stream_raw

pytestmark = pytest.mark.e2e
IDLE_MS = 800
MAX_STREAM_MS = 1500


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stream-limits")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    gateway = yaml.safe_load((policy / "gateway.yaml").read_text())
    gateway.setdefault("envoy", {})["stream_idle_timeout_ms"] = IDLE_MS
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gateway))
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["max_stream_ms"] = MAX_STREAM_MS
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    s = start_stack(tmp / "state", policy, time_scale=1.0)  # real time: a long generation takes seconds
    yield s
    s.stop()


def stream(stack: Stack, body: dict[str, Any], **headers: str) -> tuple[str, bytes, float]:
    """(request id, what arrived, seconds) of a stream that may be cut."""
    t0 = time.monotonic()
    status, rid, got = stream_raw(f"{stack.url}/v1/chat/completions", body,
                                  {"authorization": f"Bearer {DEMO_KEYS['acme']}", **headers})
    assert status == 200
    return rid, got, time.monotonic() - t0


def engine_entry(stack: Stack, rid: str) -> dict[str, Any]:
    deadline = time.time() + 5
    while time.time() < deadline:
        for url in stack.engine_urls():
            for e in request(f"{url}/admin/requests").json():
                if e["request_id"] == rid and e.get("finish_reason"):
                    return dict(e)
        time.sleep(0.05)
    raise AssertionError(f"the engine never finished {rid}")


def test_a_stall_mid_stream_is_cut_and_recorded(gw: Stack) -> None:
    marker = inject_fault(gw.engine_urls(), "stall_after=3")
    body = chat_body(content=marker, max_tokens=1000, stream=True, ignore_eos=True)  # seconds left at the stall
    rid, raw, seconds = stream(gw, body)
    got = events(raw)
    assert got and "[DONE]" not in got  # some tokens, never a normal finish
    assert seconds < IDLE_MS / 1000 + 2
    # A silence Envoy ends is a reset: no event can be added to it, and the client sees the cut.
    assert ledger_of(gw, rid)["termination"] == "stream_interrupted"
    assert engine_entry(gw, rid)["finish_reason"] == "abort"  # the engine stopped generating


def test_a_stream_longer_than_the_route_allows_ends_with_stream_interrupted(gw: Stack) -> None:
    body = chat_body(max_tokens=1000, stream=True, ignore_eos=True)
    rid, raw, seconds = stream(gw, body)
    got = events(raw)
    assert "[DONE]" not in got
    last = json.loads(got[-1])
    assert last["error"]["code"] == "stream_interrupted" and "max_stream_ms" in last["error"]["message"], last
    assert MAX_STREAM_MS / 1000 <= seconds < MAX_STREAM_MS / 1000 + 2
    entry = ledger_of(gw, rid)
    assert entry["termination"] == "stream_interrupted"
    generated = engine_entry(gw, rid)
    assert generated["finish_reason"] == "abort" and generated["output_tokens"] < 1000


def test_a_client_that_leaves_mid_stream_stops_the_engine_and_is_a_client_cancel(gw: Stack) -> None:
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(max_tokens=1000, stream=True, ignore_eos=True)),
                 {"authorization": f"Bearer {DEMO_KEYS['acme']}", "content-type": "application/json"})
    resp = conn.getresponse()
    rid, got = resp.getheader("x-request-id") or "", b""
    while got.count(b"\n\n") < 5:  # a few tokens in, then the client goes away
        chunk = resp.read1(65536)
        assert chunk, got  # the stream must still be running
        got += chunk
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    generated = engine_entry(gw, rid)
    assert generated["finish_reason"] == "abort" and generated["output_tokens"] < 1000
    entry = ledger_of(gw, rid)
    assert entry["termination"] == "client_cancel"
    # Charged for what was generated before the client left, as far as the guard counted it.
    assert entry["settlement"] == "partial" and 0 < entry["usage"]["completion_tokens"] < 1000
