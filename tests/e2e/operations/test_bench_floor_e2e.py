"""The benchmarks' floor (llmgw/bench/floor_extproc.py): the gateway's own rendered Envoy with a
minimal grpc.aio server in place of every ext_proc worker serves JSON and streams through the same
routes, so `llmgw bench overhead` can set the gateway beside what the design costs before it decides
anything. The figures themselves are docs/BENCHMARKS.md's, from the benchmark's own command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.bench.kit import POOL_ROUTE, Beside
from llmgw.bench.overhead import floor_options
from llmgw.local.stack import Stack
from tests.conftest import POLICY
from tests.helpers import request

pytestmark = pytest.mark.e2e


def test_the_floor_serves_through_the_gateways_own_envoy(tmp_path: Path) -> None:
    beside = Beside.start(POLICY, str(tmp_path / "floor-"))
    floor = Stack(floor_options(beside.gateway_options(beside.work / "floor", 2)))
    try:
        floor.start()
        assert all(json.loads(request(url).body).get("floor") is True for url in floor.status_urls)
        for stream in (False, True):
            r = request(f"{floor.url}/v1/chat/completions", "POST",
                        {"model": POOL_ROUTE, "max_tokens": 4, "stream": stream,
                         "messages": [{"role": "user", "content": "hi"}]},
                        {"authorization": f"Bearer {beside.keys['acme']}"})
            assert r.status == 200, r.body
            # The bench upstream's own answer, through the gateway's admitted route.
            assert (b"data: " in r.body) == stream and b"chatcmpl-bench" in r.body
    finally:
        floor.stop()
        beside.stop()
