"""Traces (OpenTelemetry): one server span per logical request and one client span per upstream
attempt, named and attributed after the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.usage.*`) plus the
gateway's facts (`llmgw.*`): route and revision, deployment, attempt kind, termination, settlement,
and the ledger entry (`llmgw.ledger.request_id`) every span names.

The gateway decides a request's trace when it admits it (extproc/exchange.py): the client's trace
continued (its span the parent) or a new one, and the id of the request's own span - fixed then,
because the attempts' spans, made earlier and maybe by another worker, are its children, and the
upstream's `traceparent` names it. Spans are made when what they describe has ended: an attempt's
when its answer's headers come (or it ends without them), the request's when its settlement is the
one the store keeps - so each request has one span, like its one ledger entry. The ledger is never
sampled; traces are, by trace id (`LLMGW_TRACE_SAMPLE_RATIO`, default 1), so a request's spans are
kept or dropped together whichever worker made them.

Exporters: OTLP over gRPC when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the SDK's batch processor,
in its thread: the export is a network call); JSON lines into `LLMGW_TRACES_FILE` (`llmgw up`:
`.llmgw/traces.jsonl`), buffered and appended by the event loop itself. Neither: no spans are made. No prompt,
completion, tool argument or credential is ever an attribute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

log = logging.getLogger("llmgw.tracing")
SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def new_trace_id() -> str:
    return f"{random.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    return f"{random.getrandbits(64) or 1:016x}"


def json_line(s: ReadableSpan) -> bytes:
    """A span as one line of JSON: ids in hex, times in epoch nanoseconds, the attributes. (The
    SDK's own `to_json` pretty-prints: several times the cost.)"""
    ctx = s.get_span_context()
    return orjson.dumps({
        "trace_id": f"{ctx.trace_id:032x}" if ctx else "", "span_id": f"{ctx.span_id:016x}" if ctx else "",
        "parent_id": f"{s.parent.span_id:016x}" if s.parent else None, "name": s.name, "kind": s.kind.name,
        "start_ns": s.start_time, "end_ns": s.end_time, "attributes": dict(s.attributes or {})}) + b"\n"


class Sink(Protocol):
    def on_end(self, span: ReadableSpan) -> None: ...
    def shutdown(self) -> None: ...


class LoopFileSpans:
    """The JSON-lines file without an exporter thread: each span is written into a buffer where it
    is made (the event loop), and the buffer is appended to the file by the loop every FLUSH_S. A
    batch processor's thread would take the GIL from the event loop and gRPC's threads in bursts."""

    FLUSH_S = 0.5

    def __init__(self, path: str):
        self.path = path
        self.lines: list[bytes] = []
        self.scheduled = False

    def on_end(self, span: ReadableSpan) -> None:
        self.lines.append(json_line(span))
        if not self.scheduled:
            try:
                asyncio.get_running_loop().call_later(self.FLUSH_S, self.flush)
                self.scheduled = True
            except RuntimeError:  # no loop (a command, a test): written at shutdown
                pass

    def flush(self) -> None:
        self.scheduled = False
        lines, self.lines = self.lines, []
        if lines:
            with open(self.path, "ab") as f:
                f.write(b"".join(lines))

    def shutdown(self) -> None:
        self.flush()


@dataclass(frozen=True)
class _Pipeline:
    """Where finished spans go. Spans are made as finished ReadableSpans and handed to the batch
    processors directly: every span describes something that already ended, with ids decided
    before, so the SDK's live-span machinery (context, id generator, attribute re-validation: most
    of a span's cost) has nothing to do. Sampling is TraceIdRatioBased's rule on the trace id."""

    processors: tuple[Sink, ...]
    bound: int  # a trace is kept when its id's low 64 bits are below this
    resource: Resource
    scope: InstrumentationScope


_pipeline: _Pipeline | None = None


def init() -> bool:
    """Set up the exporters the environment names; whether spans will be made."""
    global _pipeline
    endpoint, path = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), os.environ.get("LLMGW_TRACES_FILE")
    if not endpoint and not path:
        return False
    processors: list[Sink] = []
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:  # xds-protos's older copies of the OTel protos won the files (see Makefile)
            log.error("traces: the OTLP exporter cannot be loaded (%s); no spans go to %s", e, endpoint)
        else:
            processors.append(_batch(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    if path:
        processors.append(LoopFileSpans(path))
    sampler = TraceIdRatioBased(float(os.environ.get("LLMGW_TRACE_SAMPLE_RATIO", "1")))
    _pipeline = _Pipeline(tuple(processors), sampler.bound, Resource.create({"service.name": "llmgw"}),
                          InstrumentationScope("llmgw"))
    return True


def _batch(exporter: SpanExporter) -> BatchSpanProcessor:
    # Two spans a request at a worker's ~1,300 requests/s fill the SDK's default queue (2,048) within
    # one export delay when the exporter's thread waits for the GIL: a queue of 16,384 holds ~6 s.
    return BatchSpanProcessor(exporter, schedule_delay_millis=500, max_queue_size=16_384)


def shutdown() -> None:
    """Export what is still queued (at the worker's exit)."""
    if _pipeline is not None:
        for p in _pipeline.processors:
            p.shutdown()


def context_value(trace_id: str, span_id: str, parent_span_id: str) -> str:
    """The request's trace as the metadata carries it: `trace:span:parent` (parent "" for a new trace)."""
    return f"{trace_id}:{span_id}:{parent_span_id}"


def parse_context(value: str) -> tuple[str, str, str] | None:
    parts = value.split(":")
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and len(parts[0]) == 32 and len(parts[1]) == 16 else None


def _span(name: str, kind: SpanKind, trace_id: str, span_id: str | None, parent_span_id: str, start_s: float,
          end_s: float, attributes: Mapping[str, Any]) -> None:
    pipe = _pipeline
    if pipe is None:
        return
    tid = int(trace_id, 16)
    if tid & TraceIdRatioBased.TRACE_ID_LIMIT >= pipe.bound:
        return  # not sampled: neither is any other span of this trace, whichever worker makes it
    span = ReadableSpan(
        name, context=SpanContext(tid, int(span_id, 16) if span_id else random.getrandbits(64) or 1, is_remote=False,
                                  trace_flags=SAMPLED),
        parent=SpanContext(tid, int(parent_span_id, 16), is_remote=True, trace_flags=SAMPLED)
        if parent_span_id else None,
        resource=pipe.resource, kind=kind, instrumentation_scope=pipe.scope,
        # Attributes are the gateway's own facts (str, int, float, bool, lists of str): nothing to clean.
        attributes={k: v for k, v in attributes.items() if v is not None and v != ""},
        start_time=int(start_s * 1e9), end_time=int(end_s * 1e9))
    for p in pipe.processors:
        p.on_end(span)


def request_facts(route: str, request_id: str, status: int, termination: str,
                  operation: str = "chat") -> dict[str, Any]:
    """What every request span says, however the request ended: the operation (`chat`, `embeddings`),
    the route asked for, the answer's status, how it ended, and the ledger entry it names."""
    return {"gen_ai.operation.name": operation, "gen_ai.request.model": route or None, "llmgw.route": route or None,
            "http.response.status_code": status, "llmgw.termination": termination,
            "llmgw.ledger.request_id": request_id}


def request_span(context: str, route: str, start_s: float, end_s: float, attributes: Mapping[str, Any]) -> None:
    """The request's server span, with the id decided at admission."""
    parsed = parse_context(context)
    if parsed is not None:
        trace_id, span_id, parent = parsed
        operation = attributes.get("gen_ai.operation.name") or "chat"
        _span(f"{operation} {route}", SpanKind.SERVER, trace_id, span_id, parent, start_s, end_s, attributes)


def attempt_span(context: str, model: str, start_s: float, end_s: float, attributes: Mapping[str, Any]) -> None:
    """An upstream attempt's client span, a child of the request's."""
    parsed = parse_context(context)
    if parsed is not None:
        trace_id, span_id, _ = parsed
        _span(f"chat {model}", SpanKind.CLIENT, trace_id, None, span_id, start_s, end_s, attributes)
