"""The floor: the least a Python gRPC ext_proc server can cost behind the gateway's own Envoy
configuration, for `llmgw bench overhead` and `llmgw bench ablate`. The benchmark's stack runs
`python -m llmgw.bench.floor_extproc` in place of each ext_proc worker, with the worker's arguments.

It is grpc.aio, as the gateway's worker is, with nothing of the gateway: every decision message is
answered with one of two constants, built at start - the request goes on to the route's first pool by
the route the gateway takes for it (a stream's, where the Lua stream guard runs, or a JSON answer's),
the route cache cleared (what an admitting decision does), and nothing decided, reserved, redacted or
settled. Which of the two is a byte search of the body for `"stream": true`, not a parse. Every other
message (a response filter's, if a route turns one on) continues unchanged; the access log, which
Envoy sends as it does for the gateway, is read and dropped. Its status server says the
configuration's revision and that it is healthy, so the stack starts it as it starts a worker. What
the gateway costs above this is its own: the decision, the store, settlement."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from extproc.config import load_snapshot
from extproc.contract import METADATA_NAMESPACE, WORKER_HEALTH_PATH
from extproc.names import POOL_CLUSTER_PREFIX, Key, Settle
from llmgw.bench.kit import POOL_ROUTE


def admitted(cluster: str, settle: Settle) -> ep.ProcessingResponse:
    """An answer to a decision: continue to `cluster` by the route of this settle kind, matched again."""
    md = struct_pb2.Struct()
    md.fields[METADATA_NAMESPACE].struct_value.update({Key.CLUSTER: cluster, Key.SETTLE: settle.value})
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse(
        header_mutation=ep.HeaderMutation(), clear_route_cache=True)), dynamic_metadata=md)


# Every other message goes on as it came.
_CONTINUE = {"request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
             "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
             "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
             "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
             "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse())}


STREAMED = re.compile(rb'"stream"\s*:\s*true')


class Floor(ep_grpc.ExternalProcessorServicer, als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, cluster: str):
        self.json, self.stream = admitted(cluster, Settle.ACCESS_LOG), admitted(cluster, Settle.STREAM)

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: Any) -> AsyncIterator[ep.ProcessingResponse]:
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                yield self.stream if STREAMED.search(req.request_body.body) else self.json
            else:
                yield _CONTINUE[kind]

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


async def serve(args: argparse.Namespace) -> None:
    snap = load_snapshot(args.config)
    pool = snap.deployments[snap.routes[POOL_ROUTE].candidates[0].deployment_name].pool
    floor = Floor(POOL_CLUSTER_PREFIX + str(pool))
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000), ("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(floor, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(floor, server)
    if server.add_insecure_port(args.listen) == 0:
        raise OSError(f"cannot listen on {args.listen}")
    await server.start()
    async def healthy(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def status(_: web.Request) -> web.Response:
        return web.json_response({"revision": snap.revision, "floor": True})

    app = web.Application()
    app.router.add_get(WORKER_HEALTH_PATH, healthy)
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    host, port = args.status_listen.rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--status-listen", required=True)
    parser.add_argument("--tls-cert")
    args, _ = parser.parse_known_args()  # the rest of the worker's arguments mean nothing here
    if args.tls_cert:
        raise SystemExit("floor_extproc: no mTLS (the floor is measured on loopback without it)")
    asyncio.run(serve(args))  # (the stack removes a socket a worker left behind before it starts this)


if __name__ == "__main__":
    main()
