"""Settlement: every reservation ends exactly once (invariant 4), with one ledger entry
(invariant 8), written by the same store script.

- JSON answers: Envoy's gRPC access log (SettlementLog), usage copied into metadata by
  json_to_metadata; also streams Envoy cut before the stream guard saw them.
- Streams: the stream guard (extproc/streams.py) settles through the Meter's settle_stream.
- Idempotent answers: the meter, an ext_proc filter in observability mode: Envoy sends it the answer
  without waiting, and the answer becomes the recorded outcome.
- Settlements are queued and sent together (Settler); each is still its own atomic script.
- Release: a request refused after it reserved (a later stage failed) is released, charge 0.
- The sweeper: a reservation whose lease expired (the gateway lost track: crash, lost meter stream)
  is charged in full and marked `ambiguous`, so a crashed gateway never frees money it may have spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import datetime
from typing import Any

import orjson
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.config import Snapshot
from extproc.config.schema import Deployment, Prices
from extproc.contract import METADATA_NAMESPACE
from extproc.exchange import Exchange
from extproc.fallback import decode_plan
from extproc.sse import MalformedStream, SseReader, StreamUsage
from extproc.store import Settlement, Store, StoreUnavailable

log = logging.getLogger("llmgw.settlement")
ATTRIBUTES = "envoy.filters.http.ext_proc"
MAX_JSON_BODY = 8 << 20
BATCH_MAX = 128
BATCH_WAIT_S = 0.002
MD = f"metadata.filter_metadata['{METADATA_NAMESPACE}']"
# What the meter filter asks Envoy for with the first response message (render uses this list).
ANSWERED_BY = "x-llmgw-deployment"  # set by the attempt filter on a fallback route (extproc/attempts.py)
METER_ATTRIBUTES = ("request.id", "request.time", "upstream.address", "response.code",
                    f"response.headers['{ANSWERED_BY}']",
                    *(f"{MD}['{k}']" for k in ("tenant", "deployment", "redactions", "hold", "stream",
                                               "withhold_usage", "plan", "max_stream_ms")))


def answered_by(snap: Snapshot, first: str, plan: str, answered: str) -> Deployment | None:
    """The deployment whose prices apply: on a fallback route the candidate the attempt filter named,
    if the plan holds it (an upstream cannot name a pricier one); otherwise the first candidate."""
    if plan and answered and answered in decode_plan(plan)[1]:
        return snap.deployments.get(answered)
    return snap.deployments.get(first)


def first_byte_ms(request_time: str, first_at: float) -> float | None:
    """From the request's arrival at Envoy (`request.time`) to its answer's first byte."""
    try:
        return round((first_at - datetime.fromisoformat(request_time).timestamp()) * 1000, 1)
    except ValueError:
        return None


def charge_of(usage: dict[str, Any], prices: Prices) -> tuple[int, int]:
    """(micro-units, tokens) for a usage object: cached prompt tokens at the cached price."""
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = min(prompt, int(details.get("cached_tokens") or 0)) if isinstance(details, dict) else 0
    micros = math.ceil(((prompt - cached) * prices.input_per_mtok + cached * prices.cached_input_per_mtok
                        + completion * prices.output_per_mtok) / 1e6)
    return micros, prompt + completion


def termination_of(status: int, complete: bool) -> str:
    if status == 504:
        return "deadline"
    if status >= 400:
        return "upstream_error"
    return "complete" if complete else "stream_interrupted"


async def release(store: Store | None, ex: Exchange, termination: str, status: int) -> None:
    """A reserved request ended before dispatch: nothing was spent."""
    if store is None or ex.held is None or ex.identity is None:
        return
    outcome = {"termination": termination, "status": status, "settlement": "released", "usage": None,
               "attempts": []}
    try:
        await store.settle(ex.identity.tenant, ex.request_id, outcome, 0, 0, hint=ex.held.hint)
    except StoreUnavailable:
        log.error("request %s: reservation not released (store unavailable); the sweeper will settle it",
                  ex.request_id)


async def record_refusal(store: Store | None, ex: Exchange, termination: str, status: int, code: str) -> None:
    """The ledger entry of an authenticated request that never reserved (denied, refused)."""
    if store is None or ex.identity is None or ex.held is not None:
        return
    outcome = {"termination": termination, "status": status, "error": code, "settlement": "none",
               "usage": None, "attempts": []}
    try:
        await store.append_ledger(ex.identity.tenant, ex.ledger_facts(), outcome)
    except StoreUnavailable:
        log.error("request %s: ledger entry lost (store unavailable)", ex.request_id)


async def with_first(first: ep.ProcessingRequest,
                     rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingRequest]:
    """The messages of one ext_proc stream whose first message was read to choose its handler."""
    yield first
    async for m in rest:
        yield m


def attr(attrs: Any, key: str) -> str:
    """A string (or whole number, as text) from a Struct: ext_proc's CEL attributes or Envoy's metadata."""
    v = attrs.fields.get(key) if attrs is not None else None
    if v is None:
        return ""
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return str(v.string_value)
    if kind == "number_value":
        return str(int(v.number_value))
    return ""


def header_text(h: Any) -> str:
    """A HeaderValue of an ext_proc headers message: its raw bytes as UTF-8 when Envoy sent them so."""
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else str(h.value)


def header(headers: Any, key: str, default: str = "") -> str:
    """One header's value from an ext_proc HeaderMap."""
    return next((header_text(h) for h in headers.headers if h.key == key), default)


class Settler:
    """Settlements queued by the meter and the access log, sent in one store round trip for every
    batch gathered within BATCH_WAIT_S (each is still its own atomic script)."""

    def __init__(self, store: Store):
        self.store = store
        self._queue: list[Settlement] = []
        self._flushing: asyncio.Task[None] | None = None

    def submit(self, item: Settlement) -> None:
        self._queue.append(item)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._queue:
                if len(self._queue) < BATCH_MAX:
                    await asyncio.sleep(BATCH_WAIT_S)
                batch, self._queue = self._queue[:BATCH_MAX], self._queue[BATCH_MAX:]
                try:
                    await self.store.settle_many(batch)
                except StoreUnavailable:
                    log.error("%d settlement(s) failed (store unavailable); the sweeper will settle them",
                              len(batch))
        finally:
            self._flushing = None


def charge_for(usage: dict[str, Any] | None, source: str, termination: str, status: int,
               dep: Deployment | None) -> tuple[int, int, str]:
    """(micros, tokens, settlement kind): actual usage when reported; -1 (the whole reservation) when
    the engine may have worked but its usage is unknown (an answer without usage, a client that left
    before the answer); nothing for a failed answer."""
    if usage and dep is not None:
        micros, tokens = charge_of(usage, dep.prices)
        return micros, tokens, "actual" if termination == "complete" and source == "reported" else "partial"
    if 200 <= status < 300 or (termination == "client_cancel" and status == 0):
        return -1, -1, "ambiguous"
    return 0, 0, "released"


def outcome_of(termination: str, status: int, kind: str, usage: dict[str, Any] | None, source: str,
               dep: Deployment | None, redactions: str, attempt: dict[str, Any]) -> dict[str, Any]:
    """The settlement half of a ledger entry (the admission half is stored with the reservation)."""
    return {"termination": termination, "status": status, "settlement": kind, "usage": usage,
            "usage_source": source, "price_version": dep.prices.version if dep else "", "redactions": redactions,
            "attempts": [{"deployment": dep.deployment if dep else "",
                          "adapter": dep.fingerprint.adapter if dep else "", "status": status, **attempt}],
            "translation_loss": []}


class Meter:
    """One response, observed: settle when it ends, however it ends."""

    def __init__(self, settler: Settler, snapshot: Callable[[], Snapshot]):
        self.settler = settler
        self.snapshot = snapshot

    async def observe(self, first: ep.ProcessingRequest, rest: AsyncIterator[ep.ProcessingRequest]) -> None:
        first_at = time.time()  # the first message is the answer's first chunk (headers are skipped)
        attrs = first.attributes.get(ATTRIBUTES) if first.attributes else None
        tenant, rid, hint = attr(attrs, f"{MD}['tenant']"), attr(attrs, "request.id"), attr(attrs, f"{MD}['hold']")
        if not tenant or not rid or not hint:
            async for _ in rest:  # nothing to settle: drain quietly
                pass
            return
        code = attr(attrs, "response.code")
        status = int(code) if code.isdigit() else 0
        sse = attr(attrs, f"{MD}['stream']") == "1"  # the request asked to stream (ext_proc knew)
        reader, stream_usage, body, malformed = SseReader(), StreamUsage(), bytearray(), False
        complete = False


        try:
            async for msg in with_first(first, rest):
                if msg.WhichOneof("request") != "response_body":
                    continue
                chunk = msg.response_body.body
                if sse and not malformed:
                    try:
                        for data in reader.feed(chunk):
                            stream_usage.observe(data)
                    except MalformedStream:
                        malformed = True
                elif len(body) + len(chunk) <= MAX_JSON_BODY:
                    body += chunk
                if msg.response_body.end_of_stream:
                    complete = True
                    break
        finally:  # also when Envoy ends the exchange early (reset, client gone): what was seen settles
            self._settle(tenant, rid, hint, attrs, status, complete, sse, stream_usage, bytes(body), malformed,
                         first_at)

    def settle_stream(self, tenant: str, rid: str, hint: str, attrs: Any, status: int, complete: bool,
                      usage: StreamUsage, first_at: float) -> None:
        """Settle a stream the stream guard saw (complete: it finished normally; first_at: when its
        first chunk reached the guard)."""
        self._settle(tenant, rid, hint, attrs, status, complete, True, usage, b"", False, first_at)

    def _settle(self, tenant: str, rid: str, hint: str, attrs: Any, status: int, complete: bool, sse: bool,
                stream_usage: StreamUsage, body: bytes, malformed: bool, first_at: float) -> None:
        snap = self.snapshot()
        dep = answered_by(snap, attr(attrs, f"{MD}['deployment']"), attr(attrs, f"{MD}['plan']"),
                          attr(attrs, f"response.headers['{ANSWERED_BY}']"))
        held = orjson.loads(hint)
        usage: dict[str, Any] | None = None
        source = "none"
        if 200 <= status < 300:
            if sse:
                usage, source = stream_usage.usage, "reported"
                if usage is None:  # the client did not ask for usage: count chunks, bound the prompt
                    prompt_bound = held.get("p", 0)
                    usage = {"prompt_tokens": prompt_bound, "completion_tokens": stream_usage.content_chunks}
                    source = "estimated"
            else:
                with contextlib.suppress(ValueError):
                    doc = json.loads(body)
                    if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                        usage, source = doc["usage"], "reported"
        finished = complete and (not sse or stream_usage.done) and not malformed and not stream_usage.error
        termination = termination_of(status, finished)
        micros, tokens, kind = charge_for(usage, source, termination, status, dep)
        outcome = outcome_of(termination, status, kind, usage, source, dep, attr(attrs, f"{MD}['redactions']"),
                             {"upstream": attr(attrs, "upstream.address"),
                              "first_byte_ms": first_byte_ms(attr(attrs, "request.time"), first_at)})
        idem_status, idem_body = "", ""
        if held.get("i") and termination == "complete" and not sse \
                and len(body) <= snap.gateway.store.idempotency_max_body_bytes:
            idem_status, idem_body = str(status), body.decode("utf-8", "replace")
        self.settler.submit((tenant, rid, hint, outcome, micros, tokens, idem_status, idem_body,
                             snap.gateway.store.idempotency_ttl_s * 1000))


class SettlementLog(als_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access log, for JSON answers: one long-lived stream, entries in batches, each
    carrying the io.llmgw metadata (usage included, by json_to_metadata) and the response's fate."""

    def __init__(self, settler: Settler, snapshot: Callable[[], Snapshot]):
        self.settler = settler
        self.snapshot = snapshot

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                try:
                    self.settle_entry(entry)
                except Exception:  # one bad entry must not end the stream of all the others
                    log.exception("access log entry could not be settled")
        return als_pb2.StreamAccessLogsResponse()

    def settle_entry(self, entry: Any) -> None:
        common = entry.common_properties
        md = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
        if md is None:
            return
        tenant, hint, rid = attr(md, "tenant"), attr(md, "hold"), entry.request.request_id
        if not tenant or not hint or not rid:
            return
        snap = self.snapshot()
        dep = answered_by(snap, attr(md, "deployment"), attr(md, "plan"),
                          entry.response.response_headers.get(ANSWERED_BY, ""))
        status = entry.response.response_code.value
        flags = common.response_flags
        prompt = attr(md, "usage_prompt")  # present only when json_to_metadata found a usage object
        usage: dict[str, Any] | None = None
        if prompt:
            usage = {"prompt_tokens": int(prompt), "completion_tokens": int(attr(md, "usage_completion") or 0),
                     "prompt_tokens_details": {"cached_tokens": int(attr(md, "usage_cached") or 0)}}
        stream = attr(md, "stream") == "1"
        chunks = attr(md, "stream_chunks")  # the stream guard's count of what was generated before the cut
        source = "reported" if usage else "none"
        if usage is None and stream and chunks and 200 <= status < 300:
            usage = {"prompt_tokens": orjson.loads(hint).get("p", 0), "completion_tokens": int(chunks)}
            source = "estimated"
        if flags.downstream_connection_termination:
            termination = "client_cancel"
        elif (flags.upstream_request_timeout or status == 504) and not stream:
            termination = "deadline"
        else:
            # A stream reaches this log only when Envoy cut it after it started (or before its headers).
            termination = termination_of(status, not stream)
        micros, tokens, kind = charge_for(usage, source, termination, status, dep)
        upstream = common.upstream_remote_address.socket_address
        first_byte = common.time_to_first_upstream_rx_byte
        outcome = outcome_of(termination, status, kind, usage, source, dep,
                             attr(md, "redactions"), {
                                 "upstream": f"{upstream.address}:{upstream.port_value}" if upstream.address else "",
                                 "count": common.upstream_request_attempt_count,
                                 "first_byte_ms": round(first_byte.ToNanoseconds() / 1e6, 1)
                                 if common.HasField("time_to_first_upstream_rx_byte") else None})
        self.settler.submit((tenant, rid, hint, outcome, micros, tokens, "", "", 0))


class Sweeper:
    """Charges expired leases in full, marked ambiguous. Every worker sweeps; settlement is idempotent."""

    def __init__(self, store: Store, tenants: Callable[[], Iterable[str]], interval_s: float = 1.0):
        self.store, self.tenants, self.interval_s = store, tenants, interval_s

    async def sweep_once(self, now_ms: int | None = None) -> int:
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        settled = 0
        for tenant in self.tenants():
            for rid in await self.store.expired_leases(tenant, now_ms):
                outcome: dict[str, Any] = {"termination": "unknown", "settlement": "ambiguous", "usage": None,
                                           "attempts": [], "note": "lease expired before settlement: charged in full"}
                if await self.store.settle(tenant, rid, outcome, -1, -1) is not None:
                    settled += 1
                    log.warning("request %s (%s): lease expired; charged in full as ambiguous", rid, tenant)
        return settled

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep_once()
            except StoreUnavailable:
                pass  # the next round tries again; nothing is lost, leases stay in the store
            except Exception:
                log.exception("sweeper round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
