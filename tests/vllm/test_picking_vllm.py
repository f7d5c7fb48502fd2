"""Picking between two real vLLM engines from their live /metrics: a busy engine is avoided."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS
from tests.helpers import chat_body, request, request_quietly
from tests.promtext import scrape, value
from tests.vllm.conftest import MODEL, start_vllm_stack


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_vllm_stack(tmp_path_factory.mktemp("vllm2"), engines=2)
    yield stack
    stack.stop()


def _access_log(stack: Stack, request_ids: set[str]) -> dict[str, dict]:  # type: ignore[type-arg]
    found: dict[str, dict] = {}  # type: ignore[type-arg]
    deadline = time.monotonic() + 5
    while len(found) < len(request_ids) and time.monotonic() < deadline:
        time.sleep(0.3)
        for line in (stack.logs / "envoy.log").read_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry["request_id"] in request_ids:
                    found[entry["request_id"]] = entry
    return found


def _picker_sees(stack: Stack, busy: str, idle: str, deadline: float) -> bool:
    """Whether the workers' shared readings (monotonic times, host-wide) show both engines within the
    last second and `busy` running the load. The test reads them as another worker would, so it marks
    itself a reader: the scraper writes the file only while someone reads it (extproc/picker.py)."""
    shared = stack.opts.state_dir / "picker"
    while time.monotonic() < deadline:
        (shared / "readers").touch()
        try:
            loads = json.loads((shared / "loads.json").read_bytes())
        except (OSError, ValueError):
            loads = {}
        now = time.monotonic()
        if (all(ep in loads and now - loads[ep]["at"] < 1.0 for ep in (busy, idle))
                and loads[busy]["running"] >= 3):
            return True
        time.sleep(0.05)
    return False


def test_requests_avoid_the_busy_real_engine(two_engines: Stack) -> None:
    busy, idle = two_engines.engine_urls("engine-pool")
    long = chat_body(MODEL, max_tokens=900, ignore_eos=True)
    load = [threading.Thread(target=request_quietly, args=(f"{busy}/v1/chat/completions", "POST", long),
                             kwargs={"timeout": 120}, daemon=True) for _ in range(3)]
    for t in load:
        t.start()
    deadline = time.monotonic() + 10
    while value(scrape(busy), "vllm:num_requests_running") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value(scrape(busy), "vllm:num_requests_running") == 3
    # The premise: the picker's latest readings show both engines, the busy one busy. On two shared
    # cores an engine's /metrics can miss the picker's 1 s scrape timeout while the other generates,
    # and an engine without a fresh reading is (rightly) never picked: wait until both are fresh.
    busy_addr, idle_addr = busy.removeprefix("http://"), idle.removeprefix("http://")
    seen = _picker_sees(two_engines, busy_addr, idle_addr, deadline=time.monotonic() + 20)
    assert seen, "the picker never held fresh readings of both engines with the busy one busy"
    ids = set()
    for i in range(4):
        r = request(f"{two_engines.url}/v1/chat/completions", "POST", chat_body(content=f"q{i}", max_tokens=1),
                    {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=60)
        assert r.status == 200
        ids.add(r.headers["x-request-id"])
    entries = _access_log(two_engines, ids)
    assert len(entries) == 4
    got = [(e["upstream"], e["picked"]) for e in entries.values()]
    assert all(up == idle_addr and picked.startswith(idle_addr) for up, picked in got), (idle_addr, got)
