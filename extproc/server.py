"""The ext_proc gRPC service: one receive loop, one Exchange per HTTP request.

A chat completion costs one message: Envoy sends the buffered request body with the headers ext_proc
needs as CEL attributes, and ext_proc answers with its decision and closes the stream. GET /v1/models
and /v1/models/{route}, which have no body, are sent as request headers and answered from them. The
same server takes the other filters' streams by their role (the stream guard, the meter of
idempotent answers, the attempt filter) and Envoy's gRPC access log, from which settlement reads
JSON answers and failures (extproc/settlement/); every request is parsed leniently
(extproc/wire.py). A status endpoint reports the revision.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import hmac
import json
import logging
import os
import re
import signal
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import orjson
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from extproc import occupancy, tracing
from extproc.admission import AdmissionControl
from extproc.attempts import AttemptFilter
from extproc.clocks import envoy_stamp
from extproc.config import Snapshot, load_snapshot
from extproc.config.reload import Live, Reloader
from extproc.contract import MODELS_PATH, ROLE_KEY, WORKER_HEALTH_PATH, ErrorCode, GatewayError, Role
from extproc.decisions import DecisionRecorder
from extproc.envoy_msgs import header_text
from extproc.exchange import Exchange
from extproc.jwks import JwksCache
from extproc.metrics import count_refusal, exposition
from extproc.names import REQUEST_HEADER, Filter, Header
from extproc.picker import Picker
from extproc.pipeline import build_stages, run_stages
from extproc.ratelimit import RateLimitedLog
from extproc.replay import Sealer
from extproc.replies import admit, degraded_answer, immediate, longer_wait, refuse
from extproc.secrets import SecretUnavailable, resolve
from extproc.settlement.access_log import SettlementLog
from extproc.settlement.meter import Meter
from extproc.settlement.releases import DEGRADED_RELEASE, record_refusal, refusal, release
from extproc.settlement.settler import Settler
from extproc.settlement.sweeper import Sweeper
from extproc.shadow import grant_key
from extproc.shapes.door import path_of
from extproc.shapes.registry import ENDPOINTS, door_for, models_door
from extproc.stages.budget import Replay
from extproc.stages.identity import CallerIdentity
from extproc.stages.route import Degraded, tenant_salts
from extproc.store import Store, StoreUnavailable
from extproc.streams import StreamGuard
from extproc.wire import lenient_parser

log = logging.getLogger("llmgw.extproc")
# A handler of one ext_proc role: the stream's first message and the rest in, its replies out.
Handler = Callable[[ep.ProcessingRequest, AsyncIterator[ep.ProcessingRequest]], AsyncIterator[ep.ProcessingResponse]]
# The one place an unexpected exception in a decision is reported: a client must not be able to fill
# the log with tracebacks, so at most one per interval, with a count of the rest.
_internal_errors = RateLimitedLog(log, every_s=10.0)
DECISION = "decision"  # the decision filter's streams carry no role
GAVE_UP_MARGIN_S = 0.05  # a decision this close to Envoy's message timeout is taken to be too late


def apply_attributes(ex: Exchange, attrs: struct_pb2.Struct) -> None:
    """Copy the CEL attributes Envoy sent; a header the request lacks is simply absent."""
    for key, value in attrs.fields.items():
        if value.WhichOneof("kind") != "string_value":
            continue
        s = value.string_value
        if key.startswith(REQUEST_HEADER):
            ex.headers[key[len(REQUEST_HEADER):-2]] = s
        elif key == "request.id":
            ex.request_id = s
        elif key == "request.path":
            ex.path = s
        elif key == "request.method":
            ex.method = s
        elif key == "request.time":
            # Unparsable or off ext_proc's clock: keep its own, and the deadline counts from a little later.
            at = envoy_stamp(s, time.time())
            if at is not None:
                ex.arrived_at = at


def apply_headers(ex: Exchange, headers: base_pb2.HeaderMap) -> None:
    for h in headers.headers:
        value = header_text(h)
        if h.key == ":path":
            ex.path = value
        elif h.key == ":method":
            ex.method = value
        elif h.key[0] != ":":
            ex.headers[h.key] = value
    ex.request_id = ex.headers.get("x-request-id", ex.request_id)


class Processor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, live: Live | Reloader, picker: Picker | None = None, jwks: JwksCache | None = None,
                 store: Store | None = None):
        self._live = live  # a Reloader swaps its `live` on reload; a Live is fixed
        jwks = jwks or JwksCache()
        self.store = store
        self.decisions = DecisionRecorder(store)
        self.admission = (AdmissionControl(store, picker.pool_loads if picker is not None else None)
                          if store is not None else None)
        self.stages = build_stages(picker, jwks, store, self.decisions, self.admission)
        self._identity = CallerIdentity(jwks)
        self.settler = Settler(store) if store is not None else None
        self.meter = (Meter(self.settler, lambda: self.live.snapshot, lambda: self.live.sealer)
                      if self.settler is not None else None)
        self.guard = StreamGuard(self.meter) if self.meter is not None else None
        self.attempts = AttemptFilter(store, lambda: self.live)
        self._background: set[asyncio.Task[None]] = set()
        # ext_proc messages received, by role: what each kind of exchange costs in round trips
        # (GET /status reports them).
        self.messages: collections.Counter[str] = collections.Counter()
        # gRPC metadata `x-llmgw-role` -> handler; no role: the decision filter.
        self._roles: dict[str, Handler] = {Role.ATTEMPT: self.attempts.handle}
        if self.guard is not None and self.meter is not None:
            self._roles |= {Role.STREAMS: self.guard.guard, Role.METER: self.meter.meter}

    @property
    def live(self) -> Live:
        return self._live.live if isinstance(self._live, Reloader) else self._live

    def _later(self, coro: Any) -> None:
        """Ledger writes for refusals: after the reply, so a refusal is never slower for them."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        """The one receive loop: the filter's role (gRPC metadata set in the rendered Envoy config)
        chooses the handler; each takes the stream's first message and the rest."""
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        role = dict(context.invocation_metadata() or ()).get(ROLE_KEY, "") if context is not None else ""
        handler = self._roles.get(role, self.decide)
        self.messages[role or DECISION] += 1
        rest = request_iterator if handler == self.decide else self._counted(role, request_iterator)
        async for resp in handler(first, rest):
            yield resp

    async def Decide(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                     context: grpc.aio.ServicerContext) -> ep.ProcessingResponse:
        """The decision filter's stream, answered as a unary response: the decision, the gRPC status and
        the initial metadata go to Envoy in one batch (one write, one completion) instead of a message
        and then a status. A reply before it (admission's `longer_wait`) is written on its own."""
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no ProcessingRequest")
        self.messages[DECISION] += 1
        async with contextlib.aclosing(self.decide(first, request_iterator)) as replies:
            async for reply in replies:
                if not reply.HasField("override_message_timeout"):
                    return reply
                # grpc.aio applies no response serializer to a write in a unary-response handler
                await context.write(reply.SerializeToString())
        # decide() answers every request it can read; a message of another kind has no decision
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the decision filter sent no request body or headers")
        raise AssertionError("unreachable: abort raises")

    async def _counted(self, role: str, messages: AsyncIterator[ep.ProcessingRequest]) -> (
            AsyncIterator[ep.ProcessingRequest]):
        """The messages after the first, counted (the decision's stream has no more)."""
        async for m in messages:
            self.messages[role] += 1
            yield m

    async def decide(self, first: ep.ProcessingRequest,
                     _rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncGenerator[ep.ProcessingResponse, None]:
        """The decision filter. One message decides: Envoy sends the buffered body (or, for the model
        list, the headers) and nothing after it. The stream is closed as soon as the decision is sent,
        so an admitted request no longer depends on this worker: Envoy ignores a processor that closed
        cleanly (only a gRPC error ends the request), and the worker may restart while it runs."""
        live = self.live
        # The whole request is decided under this one revision, whatever a reload does meanwhile.
        ex = Exchange(snapshot=live.snapshot, cache_salts=live.cache_salts, sealer=live.sealer,
                      shadow_key=live.shadow_key, region=live.region, credentials=live.credentials,
                      credential_errors=live.credential_errors)
        attrs = first.attributes.get(Filter.EXT_PROC) if first.attributes else None
        if attrs is not None:
            apply_attributes(ex, attrs)
        kind = first.WhichOneof("request")
        timeout_s = ex.snapshot.gateway.envoy.extproc_message_timeout_ms / 1000
        envoy_waits_until = ex.received_at + timeout_s  # then Envoy answers 503 itself and closes the stream

        def gave_up() -> bool:
            """Envoy has stopped waiting: whatever this decision says, the caller got Envoy's own 503."""
            return time.monotonic() >= envoy_waits_until - GAVE_UP_MARGIN_S
        try:
            match kind:
                case "request_body":
                    ex.raw_body = first.request_body.body
                    door = door_for(ex.path)  # once: identity and intake both need it
                    ex.door = door.name if door is not None else ""
                    resume = await run_stages(self.stages, ex)
                    while resume is not None:  # admission queued it: Envoy is told to wait, then it waits
                        waiting, ex.waiting = ex.waiting, None
                        try:
                            yield longer_wait(waiting.wait_s + timeout_s)
                        except GeneratorExit:  # the stream closed while the reply was on its way
                            waiting.abandon()
                            self._release_undecided(ex, gave_up=False)
                            raise
                        envoy_waits_until = time.monotonic() + waiting.wait_s + timeout_s
                        await waiting.wait()
                        resume = await run_stages(self.stages, ex, resume)
                    yield admit(ex)
                case "request_headers":
                    apply_headers(ex, first.request_headers.headers)
                    yield await self._models(ex)
                case _:
                    _internal_errors.warning("unexpected first ext_proc message %s", kind)
        except Replay as replay:  # Idempotency-Key seen and completed: its recorded outcome
            # Scheduled before the reply: Envoy may close the stream once it has it, and code after
            # the last yield would then never run.
            answer = replay.answer
            self._later(record_refusal(self.store, ex, "idempotent_replay", answer.status, ""))
            yield immediate(ex, answer.status, answer.body, "llmgw_idempotent_replay",
                            {Header.IDEMPOTENT_REPLAY: "true"}, content_type=answer.content_type)
        except Degraded as degraded:  # no candidate qualified: the route's fixed answer, nothing spent
            ex.degraded = "response"
            if gave_up():
                self._ended(ex, too_late(), gave_up=True)
            else:
                self._later(release(self.store, ex, DEGRADED_RELEASE[0], 200, DEGRADED_RELEASE[1])
                            if ex.held is not None else record_refusal(self.store, ex, "degraded", 200, ""))
            yield degraded_answer(ex, degraded.text)
        except GatewayError as err:
            self._ended(ex, err, gave_up())
            yield refuse(ex, err)
        except asyncio.CancelledError:
            self._release_undecided(ex, gave_up=gave_up())
            raise
        except Exception:  # never crash on input: fail closed with the contract's error
            _internal_errors.error("request %s: internal error", ex.request_id, exc_info=True)
            failure = GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the gateway could not evaluate this request")
            self._ended(ex, failure, gave_up())
            yield refuse(ex, failure)

    def _release_undecided(self, ex: Exchange, gave_up: bool) -> None:
        """Envoy closed the stream before the decision: it stopped waiting (`gave_up`: its 503, which the
        access log also releases), or the client went away (which nothing else would release before the
        lease expired and charged it in full). Released now either way, named as the access log would."""
        if ex.held is not None:
            termination, status = ("not_processed", 503) if gave_up else ("cancelled", 499)
            self._later(release(self.store, ex, termination, status))

    def _ended(self, ex: Exchange, err: GatewayError, gave_up: bool) -> None:
        """A refused request: release what it reserved, or record the refusal in the ledger. A refusal
        decided after Envoy stopped waiting never reached the caller, who got Envoy's 503: its ledger
        entry says that (`not_processed`), as the access log's release of it does, so whichever of the
        two settles first the ledger says one thing."""
        if gave_up:
            err = too_late()
        termination, marks = ("not_processed", {}) if gave_up else refusal(err.code.value, err.param)
        route = ex.route_asked()
        count_refusal(route, err.code.value)
        if ex.trace_id and ex.identity is not None:  # a request the ledger records: its span too
            tracing.request_span(ex.trace_context, route, ex.arrived_at, time.time(), {
                **tracing.request_facts(route, ex.request_id, err.status, termination, ex.operation),
                "error.type": err.code.value})
        if ex.held is not None:
            self._later(release(self.store, ex, termination, err.status, marks))
        elif ex.identity is not None:  # a store that is down takes it when it is back (record_refusal)
            self._later(record_refusal(self.store, ex, termination, err.status, err.code.value, err.param))

    async def _models(self, ex: Exchange) -> ep.ProcessingResponse:
        """GET /v1/models and /v1/models/{route} (and a door's own model paths) are sent with their
        headers: answered from the routes, in the shape of the SDK that asked. So is every path the
        gateway does not serve: its caller, once identified, is told what it does serve, in the shape
        its SDK's headers say, and the refusal is ledgered."""
        path = path_of(ex.path)
        door = models_door(path, ex.headers)
        own = door is not None and door.models_path and re.fullmatch(door.models_path, path)
        ex.door = door.name if door is not None else ""  # its errors in the door's shape too
        await self._identity.run(ex)
        if ex.method != "GET" or not (own or path == MODELS_PATH or path.startswith(MODELS_PATH + "/")):
            ex.unserved = True
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND,
                               f"no such endpoint: {ex.method} {path}; this gateway serves {', '.join(ENDPOINTS)}")
        name = urllib.parse.unquote(path.rstrip("/").partition("/models")[2].lstrip("/"))
        snap = ex.snapshot
        if name and name not in snap.routes:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, "no route of that name", "model")
        if door is None or door.model_object is None or door.model_list is None:
            doc = model_object(name) if name else {"object": "list", "data": [model_object(n) for n in
                                                                              sorted(snap.routes)]}
        else:
            make = door.model_object

            def shaped(route: str) -> dict[str, Any]:  # its limits: the smallest window, the route's cap
                r = snap.routes[route]
                window = min((snap.deployments[c.deployment_name].context_window for c in r.candidates), default=0)
                return make(route, window, r.max_tokens_cap or window)
            # A door's SDK calls chat routes only: its list leaves the embeddings routes out (a lookup
            # by name still answers, as the route exists).
            chats = sorted(n for n, r in snap.routes.items() if r.serves == "chat")
            doc = shaped(name) if name else door.model_list([shaped(n) for n in chats])
        return immediate(ex, 200, orjson.dumps(doc), "llmgw_models")


class ExtProcHandlers(grpc.GenericRpcHandler):
    """ext_proc's one method, handled by the stream's role (gRPC metadata the rendered filter sets):
    the decision filter's streams (no role) as stream-unary, every other filter's as bidirectional."""

    METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

    def __init__(self, processor: Processor):
        parse, serialize = lenient_parser(ep.ProcessingRequest), ep.ProcessingResponse.SerializeToString
        self.decision = grpc.stream_unary_rpc_method_handler(processor.Decide, parse, serialize)
        self.filters = grpc.stream_stream_rpc_method_handler(processor.Process, parse, serialize)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method != self.METHOD:
            return None
        role = any(k == ROLE_KEY for k, _ in details.invocation_metadata or ())
        return self.filters if role else self.decision


def add_services(server: grpc.aio.Server, processor: Processor,
                 access_log: als_grpc.AccessLogServiceServicer | None) -> None:
    """ext_proc and the access log, as the generated `add_*_to_server` would register them, but with
    a lenient request parser: a client's non-UTF-8 header bytes must not end the gRPC stream
    (extproc/wire.py)."""
    server.add_generic_rpc_handlers((ExtProcHandlers(processor),))
    if access_log is not None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "envoy.service.accesslog.v3.AccessLogService", {"StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                access_log.StreamAccessLogs, request_deserializer=lenient_parser(als_pb2.StreamAccessLogsMessage),
                response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString)}),))


def model_object(route: str) -> dict[str, Any]:
    """A route as OpenAI's model object (what `client.models.list()` / `.retrieve()` return)."""
    return {"id": route, "object": "model", "created": 0, "owned_by": "llmgw"}


def live_for(snapshot: Snapshot, region: str = "") -> Live:
    """The secrets a revision is served with: the gateway's own stop it when they cannot be resolved
    (fail closed); a deployment's credential that cannot be resolved makes that deployment
    unaddressable (its attempts are refused), and is logged now."""
    ref = snapshot.gateway.store.replay_key_ref
    # The gateway's own secret (a missing one stops the service from starting: fail closed): the
    # tenants' prefix-cache salts and the shadow grants' key derive from it; every host shares it.
    secret = resolve(snapshot.gateway.cache_salt_secret_ref, snapshot.directory)
    live = Live(snapshot, tenant_salts(secret, snapshot.gateway.tenants),
                Sealer(resolve(ref, snapshot.directory) if ref else None), shadow_key=grant_key(secret),
                region=region)
    for dep in snapshot.deployments.values():
        if dep.credential_ref:
            try:
                live.credentials[dep.deployment] = resolve(dep.credential_ref, snapshot.directory)
            except SecretUnavailable as e:
                live.credential_errors[dep.deployment] = str(e)
                log.error("deployment %s cannot be addressed: %s", dep.deployment, e)
    return live


def _peer_gone(record: logging.LogRecord) -> bool:
    """gRPC logs, with a traceback, a stream's final status it could not send because Envoy had already
    closed the stream (its client left): nothing was lost, so it is one line at INFO instead."""
    error = record.exc_info[1] if record.exc_info else None
    if error is not None and type(error).__name__ == "ExecuteBatchError" and "SendStatusFromServer" in str(error):
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.INFO, "INFO", None, None
        record.msg, record.args = "a stream's final status was not sent: Envoy had closed the stream", ()
    return True


def too_late() -> GatewayError:
    """What the caller of a decision that came after Envoy's message timeout got: Envoy's own 503."""
    return GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the decision came after Envoy stopped waiting")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_name(host: str) -> str:
    """A Host header's name, without its port or an IPv6 literal's brackets."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def status_guards(listen_host: str, token: str | None) -> Any:
    """The status server's two guards (issue 27): on a loopback address it answers only requests that
    name a loopback Host (a page in a local browser, its name pointed at 127.0.0.1, cannot use it);
    beyond loopback (docker-compose, where Prometheus scrapes it by service name) every Host is
    served. Either way a request that changes something (POST /reload) carries the token from the
    state directory as its bearer credential; without a token configured, the endpoint is off
    (SIGHUP and the policy directory's watcher still reload)."""
    loopback_only = host_name(listen_host) in LOOPBACK_HOSTS

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if loopback_only and host_name(request.host or "") not in LOOPBACK_HOSTS:
            return web.json_response({"error": "this server answers only requests to a loopback host"}, status=403)
        if request.method != "GET":
            if token is None:
                return web.json_response({"error": "POST /reload is off: start ext_proc with --admin-token-file "
                                                   "(SIGHUP reloads too)"}, status=403)
            sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(sent.encode(), token.encode()):
                return web.json_response({"error": "a valid admin token is required"}, status=401,
                                         headers={"www-authenticate": "Bearer"})
        return await handler(request)
    return guard


def _loops(path: Path | None) -> Any:
    """The supervised loops' state as `llmgw up` last wrote it (llmgw/ops/loops.py); {} when none run."""
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}


async def status_app(reloader: Reloader, listen: str, processor: Processor | None = None,
                     access_log: SettlementLog | None = None, picker: Picker | None = None,
                     admin_token: str | None = None, loops_state: Path | None = None) -> web.AppRunner:
    """GET /status: the serving revision, the last reload's outcome (errors name file and field),
    and what this worker has received (ext_proc messages, access-log entries) and scraped. GET
    /metrics: Prometheus text for every worker of this host (extproc/metrics.py). POST /reload, with
    the admin token (status_guards)."""
    async def status(_: web.Request) -> web.Response:
        counts = {"extproc_messages": dict(processor.messages) if processor is not None else {},
                  "access_log_entries": access_log.entries if access_log is not None else 0,
                  "metrics_scrapes": picker.scrapes if picker is not None else 0,
                  "picker": picker.status() if picker is not None else None,
                  "admission": processor.admission.status() if processor is not None and processor.admission else {},
                  **(processor.decisions.status() if processor is not None else {})}
        return web.json_response({**reloader.status, **counts, "loops": _loops(loops_state)})

    async def reload(_: web.Request) -> web.Response:
        reloader.reload("admin request")
        return web.json_response(reloader.status)

    async def metrics(_: web.Request) -> web.Response:
        text, content_type = exposition()
        held = await occupancy.exposition(processor.store if processor is not None else None,
                                          reloader.live.snapshot)
        return web.Response(body=text + held, headers={"Content-Type": content_type})

    async def healthz(_: web.Request) -> web.Response:
        # Answered by the event loop that decides requests: a loop too busy to answer this in time is
        # too busy to decide (Envoy's health check and the supervisor take the worker out, then restart it).
        return web.Response(text="ok")

    host, _, port = listen.rpartition(":")
    app = web.Application(middlewares=[status_guards(host, admin_token)])
    app.router.add_get(WORKER_HEALTH_PATH, healthz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reload", reload)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    return runner


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """mTLS for Envoy -> ext_proc: ext_proc presents `cert` and admits only clients signed by the CA."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_server_credentials([(read(key), read(cert))], root_certificates=read(client_ca),
                                       require_client_auth=True)


def pool_endpoints(snapshot: Snapshot, overrides: list[str]) -> dict[str, list[str]]:
    """The engines of each pool: gateway.yaml's, or `--pool NAME=host:port,...` where Envoy was
    rendered with other addresses (llmgw up on free ports)."""
    pools = {name: list(pool.endpoints) for name, pool in snapshot.gateway.pools.items()}
    for item in overrides:
        name, _, eps = item.partition("=")
        if name not in pools:
            raise SystemExit(f"ext_proc: --pool names unknown pool {name!r}")
        pools[name] = [e for e in eps.split(",") if e]
    return pools


async def serve(reloader: Reloader, listen: str, pools: Mapping[str, list[str]] | None = None,
                status_listen: str | None = None, credentials: grpc.ServerCredentials | None = None,
                store_url: str | None = None, picker_dir: Path | None = None,
                admin_token: str | None = None, loops_state: Path | None = None,
                socket_mode: int | None = None) -> None:
    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", 100_000),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.so_reuseport", 0),
    ])
    picker = Picker(pools, shared_dir=picker_dir) if pools else None
    if picker is not None:
        await picker.start()
    if tracing.init():
        log.info("traces exported (%s)", ", ".join(k for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "LLMGW_TRACES_FILE")
                                                   if os.environ.get(k)))
    jwks = JwksCache()
    store_cfg = reloader.live.snapshot.gateway.store
    store_url = store_url or store_cfg.url
    store = Store.from_settings(store_url, store_cfg) if store_url else None
    if store is not None:
        try:
            await store.prepare()
        except StoreUnavailable as e:  # not fatal: requests that need the store are refused until it is back
            log.warning("store not reachable at start (%s); requests that need it are refused until it is", e)
    processor = Processor(reloader, picker, jwks, store)
    settlement_log = (SettlementLog(processor.settler, lambda: reloader.live.snapshot)
                      if processor.settler is not None else None)
    add_services(server, processor, settlement_log)  # JSON answers and streams settle through the access log
    bound = (server.add_secure_port(listen, credentials) if credentials is not None
             else server.add_insecure_port(listen))
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    if socket_mode is not None and listen.startswith("unix:"):
        os.chmod(listen.removeprefix("unix:"), socket_mode)
    runner = (await status_app(reloader, status_listen, processor, settlement_log, picker, admin_token, loops_state)
              if status_listen else None)
    log.info("ext_proc listening on %s%s, revision %s", listen, " (mTLS)" if credentials else "",
             reloader.live.snapshot.revision)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    watcher = asyncio.create_task(reloader.watch(stop))
    sweeper = (asyncio.create_task(Sweeper(store, lambda: reloader.live.snapshot.gateway.tenants).run(stop))
               if store is not None else None)
    await stop.wait()
    await watcher
    if sweeper is not None:
        await sweeper
    await server.stop(grace=2)
    if processor.admission is not None:
        await processor.admission.stop()
    tracing.shutdown()
    if runner is not None:
        await runner.cleanup()
    if picker is not None:
        await picker.stop()
    if store is not None:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m extproc", description="llmgw ext_proc service")
    p.add_argument("--config", required=True, help="policy directory")
    p.add_argument("--listen", default="127.0.0.1:50051")
    p.add_argument("--socket-mode", type=lambda v: int(v, 8), metavar="OCTAL",
                   help="with --listen unix:PATH: the socket's mode (default: the umask's). Envoy must be able to "
                        "write to it: where it runs as another user, e.g. 666 in a directory only Envoy and ext_proc "
                        "mount (docker-compose.yml)")
    p.add_argument("--pool", action="append", default=[], metavar="NAME=HOST:PORT,...",
                   help="a pool's engine addresses, where they differ from gateway.yaml's")
    p.add_argument("--no-picker", action="store_true", help="leave engine choice to Envoy's least-request")
    p.add_argument("--picker-dir", type=Path, default=os.environ.get("LLMGW_PICKER_DIR") or None,
                   help="a directory the workers on this host share, so one of them scrapes the engines for all "
                        "(default $LLMGW_PICKER_DIR; none: each worker scrapes)")
    p.add_argument("--status-listen", metavar="HOST:PORT", help="serve GET /status (revision, last reload)")
    p.add_argument("--admin-token-file", type=Path,
                   help="the status server's POST /reload needs this file's token as its bearer credential "
                        "(without it, the endpoint is off: SIGHUP reloads)")
    p.add_argument("--loops-state", type=Path,
                   help="the JSON file `llmgw up`'s supervised loops write their state to (GET /status shows it)")
    p.add_argument("--store-url", help="redis:// URL of the budget store (default: gateway.yaml store.url)")
    p.add_argument("--reload-runs-policy-tests", action="store_true",
                   help="refuse a new revision whose Rego test_* rules fail")
    p.add_argument("--tls-cert", help="mTLS: ext_proc's certificate (PEM)")
    p.add_argument("--tls-key", help="mTLS: ext_proc's private key (PEM)")
    p.add_argument("--tls-client-ca", help="mTLS: CA that signs Envoy's client certificate (PEM)")
    p.add_argument("--no-decision-cache", action="store_true",
                   help="evaluate Rego for every request even when the policy is pure (benchmarks)")
    p.add_argument("--public-address", default=os.environ.get("LLMGW_PUBLIC_ADDRESS", "127.0.0.1"),
                   help="where clients reach the gateway (default $LLMGW_PUBLIC_ADDRESS or loopback): beyond "
                        "loopback, demo keys are refused")
    p.add_argument("--region", default=os.environ.get("LLMGW_REGION", ""),
                   help="the region this gateway runs in: a tenant whose residency excludes it is refused (403)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.no_decision_cache:
        from extproc.config import policy

        policy.DECISION_CACHE = False
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(_peer_gone)
    snapshot = load_snapshot(args.config)
    exposed = snapshot.demo_keys_exposed_on(args.public_address)
    if exposed:
        raise SystemExit(f"ext_proc: refusing to serve a gateway published on {args.public_address} while demo keys "
                         f"are configured ({', '.join(exposed)}): revoke them and make real ones (`llmgw keys`)")
    try:
        live = live_for(snapshot, args.region)
    except SecretUnavailable as e:
        raise SystemExit(f"ext_proc: {e}") from None
    tls = (args.tls_cert, args.tls_key, args.tls_client_ca)
    if any(tls) and not all(tls):
        raise SystemExit("ext_proc: --tls-cert, --tls-key and --tls-client-ca go together")
    credentials = server_credentials(*tls) if all(tls) else None
    import uvloop

    uvloop.install()
    reloader = Reloader(snapshot.directory, functools.partial(live_for, region=args.region), live,
                        run_tests=args.reload_runs_policy_tests)
    pools = None if args.no_picker else pool_endpoints(snapshot, args.pool)
    token = args.admin_token_file.read_text().strip() if args.admin_token_file else None
    asyncio.run(serve(reloader, args.listen, pools, args.status_listen, credentials, args.store_url,
                      args.picker_dir, token or None, args.loops_state, args.socket_mode))
