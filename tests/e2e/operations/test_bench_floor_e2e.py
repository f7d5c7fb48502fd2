"""The benchmarks' floor (llmgw/bench/floor_extproc.py): the gateway's own rendered Envoy with a
minimal grpc.aio server in place of every ext_proc worker serves JSON and streams through the same
routes, so `llmgw bench overhead` can set the gateway beside what the design costs before it decides
anything. The figures themselves are docs/BENCHMARKS.md's, from the benchmark's own command."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.contract import METADATA_NAMESPACE
from extproc.names import Key, Settle
from llmgw.bench.ablate import FLOOR, with_variant
from llmgw.bench.floor_extproc import Floor
from llmgw.bench.kit import POOL_ROUTE, Beside
from llmgw.local.stack import Stack
from tests.conftest import POLICY
from tests.helpers import request

pytestmark = pytest.mark.e2e


def test_the_floor_serves_through_the_gateways_own_envoy(tmp_path: Path) -> None:
    beside = Beside.start(POLICY, str(tmp_path / "floor-"))
    floor = Stack(with_variant(beside.gateway_options(beside.work / "floor", 2), FLOOR))
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


def test_the_floor_sends_a_stream_by_the_gateways_stream_route() -> None:
    """The route, and so the filters Envoy runs (the Lua stream guard for a stream), are the gateway's:
    the constant names the settle kind the route matches on."""
    async def settle_of(body: bytes) -> str:
        async def one() -> AsyncIterator[ep.ProcessingRequest]:
            yield ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
        replies = [r async for r in Floor("pool_engine-pool").Process(one(), None)]
        md = replies[0].dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        assert md[Key.CLUSTER].string_value == "pool_engine-pool"
        return str(md[Key.SETTLE].string_value)
    assert asyncio.run(settle_of(b'{"model": "m", "stream": true, "messages": []}')) == Settle.STREAM
    assert asyncio.run(settle_of(b'{"model":"m","stream":true}')) == Settle.STREAM
    assert asyncio.run(settle_of(b'{"model": "m", "stream": false}')) == Settle.ACCESS_LOG
    assert asyncio.run(settle_of(b'{"model": "m"}')) == Settle.ACCESS_LOG
