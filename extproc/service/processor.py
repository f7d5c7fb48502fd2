"""The ext_proc gRPC service: one receive loop per stream, its handler chosen by the filter's role (gRPC
metadata the rendered Envoy config sets): the decision filter (extproc/service/decision.py), the
stream guard (extproc/service/streams.py), the meter of idempotent and checked answers
(extproc/settlement/meter.py) and the attempt filter (extproc/service/attempts.py). Every request is parsed
leniently (extproc/wire.py)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from extproc.admission import AdmissionControl
from extproc.config.reload import Live, Reloader
from extproc.contract import ROLE_KEY, Role
from extproc.decisions import DecisionRecorder
from extproc.jwks import JwksCache
from extproc.picker import Picker
from extproc.service.attempts import AttemptFilter
from extproc.service.decision import DecisionFilter
from extproc.service.streams import StreamGuard
from extproc.settlement.meter import Meter
from extproc.settlement.settler import Settler
from extproc.slices import SliceBook
from extproc.store import Store
from extproc.wire import lenient_parser

DECISION = "decision"  # the decision filter's streams carry no role

Handler = Callable[[ep.ProcessingRequest, AsyncIterator[ep.ProcessingRequest]], AsyncIterator[ep.ProcessingResponse]]


class Processor(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service's one method, by the stream's role: the decision filter (no role), the
    stream guard, the meter of idempotent answers and the attempt filter."""

    def __init__(self, live: Live | Reloader, picker: Picker | None = None, jwks: JwksCache | None = None,
                 store: Store | None = None):
        self._live = live  # a Reloader swaps its `live` on reload; a Live is fixed
        jwks = jwks or JwksCache()
        self.store = store
        self.decisions = DecisionRecorder(store)
        self.admission = (AdmissionControl(store, picker.pool_loads if picker is not None else None)
                          if store is not None else None)
        # This worker's slices of tenants' budgets (extproc/slices.py; used where gateway.yaml turns them on).
        self.slices = SliceBook(store) if store is not None else None
        self.decision = DecisionFilter(lambda: self.live, picker, jwks, store, self.decisions, self.admission,
                                       self.slices)
        self.settler = Settler(store) if store is not None else None
        self.meter = (Meter(self.settler, lambda: self.live.snapshot, lambda: self.live.sealer)
                      if self.settler is not None else None)
        self.guard = StreamGuard(self.meter) if self.meter is not None else None
        self.attempts = AttemptFilter(store, lambda: self.live)
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
        handler = self._roles.get(role, self.decision.decide)
        self.messages[role or DECISION] += 1
        rest = request_iterator if handler == self.decision.decide else self._counted(role, request_iterator)
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
        async with contextlib.aclosing(self.decision.decide(first, request_iterator)) as replies:
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
