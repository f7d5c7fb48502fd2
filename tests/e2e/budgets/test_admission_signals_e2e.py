"""The pool's bound follows its engines' own signals (extproc/admission.py, issue 33 item 1): engines
that run one sequence each (`--max-num-seqs 1`) and report the rest as waiting shrink the bound from
its ceiling (64) to what they run, so the next request waits in the gateway - where priority and
fairness order it - instead of in an engine's first-come queue; once they drain it is admitted."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import Response, request

pytestmark = pytest.mark.e2e


def one_sequence_engines(tmp: Path) -> Path:
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["pools"]["engine-pool"]["admission"] = {"max_in_flight": 64, "waiting_per_engine": 0}
    gw["request_classes"]["read_only_chat"]["queue_ttl_ms"] = 8000
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return policy


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("admission-signals")
    s = start_stack(tmp / "state", one_sequence_engines(tmp), time_scale=1.0, engine_args=("--max-num-seqs", "1"))
    yield s
    s.stop()


def send(gw: Stack, max_tokens: int) -> Response:
    return request(f"{gw.url}/v1/chat/completions", "POST", {
        "model": "chat-default", "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "count slowly"}]},
        {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)


def waiting_at_engines(gw: Stack) -> float:
    total = 0.0
    for url in gw.engine_urls("engine-pool"):
        for line in request(f"{url}/metrics").body.decode().splitlines():
            if line.startswith("vllm:num_requests_waiting"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_engines_that_queue_shrink_the_bound_and_the_next_request_waits_in_the_gateway(gw: Stack) -> None:
    with ThreadPoolExecutor(5) as pool:
        first = [pool.submit(send, gw, 120) for _ in range(4)]  # two run, two wait at the engines
        deadline = time.monotonic() + 10
        while waiting_at_engines(gw) < 2:
            assert time.monotonic() < deadline, "the engines never queued"
            time.sleep(0.05)
        time.sleep(0.3)  # the picker's readings (every 75 ms) show the engines' queue
        r = send(gw, 4)
        assert r.status == 200, r.body
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        # Four in flight against a ceiling of 64: only the engines' signals held it back.
        assert entry.get("admission", "").startswith("queued_ms="), entry
        assert int(entry["admission"].removeprefix("queued_ms=")) > 200, entry
        assert all(f.result().status == 200 for f in first)
