"""Settlement: every reservation ends exactly once (invariant 4), with one ledger record
(invariant 8), written by the same store script.

- The meter: a second ext_proc filter in observability mode sends the response (headers, body
  chunks) without waiting for answers, so reading usage costs the client nothing. At the end of the
  response it settles to actual usage; a response cut short settles partial usage.
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
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.config import Snapshot
from extproc.config.schema import Prices
from extproc.contract import METADATA_NAMESPACE
from extproc.exchange import Exchange
from extproc.sse import MalformedStream, SseReader, StreamUsage
from extproc.store import Store, StoreUnavailable

log = logging.getLogger("llmgw.settlement")
ATTRIBUTES = "envoy.filters.http.ext_proc"
MAX_JSON_BODY = 8 << 20
_MD = f"metadata.filter_metadata['{METADATA_NAMESPACE}']"
# What the meter filter asks Envoy for with the response headers (render uses this list).
METER_ATTRIBUTES = ("request.id", "upstream.address", *(f"{_MD}['{k}']" for k in (
    "tenant", "deployment", "reserved", "redactions", "revision")))


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
    record = {**ex.ledger_facts(), "termination": termination, "status": status, "settlement": "released",
              "price_version": ex.held.price_version, "usage": None, "attempts": []}
    try:
        await store.settle(ex.identity.tenant, ex.request_id, record, 0, 0)
    except StoreUnavailable:
        log.error("request %s: reservation not released (store unavailable); the sweeper will settle it",
                  ex.request_id)


async def record_refusal(store: Store | None, ex: Exchange, termination: str, status: int, code: str) -> None:
    """The ledger record of an authenticated request that never reserved (denied, refused)."""
    if store is None or ex.identity is None or ex.held is not None:
        return
    record = {**ex.ledger_facts(), "termination": termination, "status": status, "error": code,
              "settlement": "none", "usage": None, "attempts": []}
    try:
        await store.append_ledger(ex.identity.tenant, record)
    except StoreUnavailable:
        log.error("request %s: ledger record lost (store unavailable)", ex.request_id)


def _attr(attrs: Any, key: str) -> str:
    v = attrs.fields.get(key) if attrs is not None else None
    return v.string_value if v is not None and v.WhichOneof("kind") == "string_value" else ""


class Meter:
    """One response, observed: settle when it ends, however it ends."""

    def __init__(self, store: Store, snapshot: Callable[[], Snapshot]):
        self.store = store
        self.snapshot = snapshot

    async def observe(self, first: ep.ProcessingRequest, rest: AsyncIterator[ep.ProcessingRequest]) -> None:
        attrs = first.attributes.get(ATTRIBUTES) if first.attributes else None
        tenant, rid = _attr(attrs, f"{_MD}['tenant']"), _attr(attrs, "request.id")
        if not tenant or not rid or _attr(attrs, f"{_MD}['reserved']") != "1":
            async for _ in rest:  # nothing to settle: drain quietly
                pass
            return
        status, content_type = 0, ""
        for h in first.response_headers.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            if h.key == ":status":
                status = int(value) if value.isdigit() else 0
            elif h.key == "content-type":
                content_type = value
        sse = content_type.startswith("text/event-stream")
        reader, stream_usage, body, malformed = SseReader(), StreamUsage(), bytearray(), False
        t0 = time.monotonic()
        first_byte_ms: float | None = None
        complete = first.response_headers.end_of_stream
        async for msg in rest:
            if msg.WhichOneof("request") != "response_body":
                continue
            chunk = msg.response_body.body
            if chunk and first_byte_ms is None:
                first_byte_ms = (time.monotonic() - t0) * 1000
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
        await self._settle(tenant, rid, attrs, status, complete, sse, stream_usage, bytes(body), malformed,
                           first_byte_ms)

    async def _settle(self, tenant: str, rid: str, attrs: Any, status: int, complete: bool, sse: bool,
                      stream_usage: StreamUsage, body: bytes, malformed: bool, first_byte_ms: float | None) -> None:
        snap = self.snapshot()
        dep = snap.deployments.get(_attr(attrs, f"{_MD}['deployment']"))
        try:
            held = await self.store.reservation(tenant, rid)
            if not held:
                return  # settled already (the sweeper, or a duplicate stream)
            facts = json.loads(held.get("record") or "{}")
            usage: dict[str, Any] | None = None
            source = "none"
            if 200 <= status < 300:
                if sse:
                    usage, source = stream_usage.usage, "reported"
                    if usage is None:  # the client did not ask for usage: count chunks, bound the prompt
                        usage = {"prompt_tokens": facts.get("prompt_bound", 0),
                                 "completion_tokens": stream_usage.content_chunks}
                        source = "estimated"
                else:
                    try:
                        doc = json.loads(body)
                        usage, source = (doc.get("usage"), "reported") if isinstance(doc, dict) else (None, "none")
                    except ValueError:
                        usage = None
            sse_complete = complete and (not sse or stream_usage.done) and not malformed and not stream_usage.error
            termination = termination_of(status, sse_complete)
            if usage and dep is not None:
                micros, tokens = charge_of(usage, dep.prices)
                kind = "actual" if termination == "complete" and source == "reported" else "partial"
            elif 200 <= status < 300 and dep is not None:  # answered but no usage: charge what was reserved
                micros, tokens, kind = -1, -1, "ambiguous"
            else:
                micros, tokens, kind = 0, 0, "released"
            reserved_m, reserved_t = int(held.get("micros", 0)), int(held.get("tokens", 0))
            overrun = micros > reserved_m or tokens > reserved_t
            if overrun:  # never settle past the reservation: invariant 3 holds whatever the upstream did
                micros, tokens = min(micros, reserved_m), min(tokens, reserved_t)
            record = {**facts, "termination": termination, "status": status, "settlement": kind,
                      "usage": usage, "usage_source": source, "overrun": overrun,
                      "price_version": dep.prices.version if dep else "",
                      "redactions": _attr(attrs, f"{_MD}['redactions']"),
                      "attempts": [{"deployment": dep.deployment if dep else "", "adapter": dep.fingerprint.adapter
                                    if dep else "", "upstream": _attr(attrs, "upstream.address"), "status": status,
                                    "first_byte_ms": round(first_byte_ms, 1) if first_byte_ms is not None else None}],
                      "translation_loss": []}
            idem_status, idem_body = "", ""
            if held.get("idem") and termination == "complete" and not sse:
                limit = snap.gateway.store.idempotency_max_body_bytes
                idem_status, idem_body = str(status), body.decode("utf-8", "replace") if len(body) <= limit else ""
            await self.store.settle(tenant, rid, record, micros, tokens, idem_status if idem_body else "",
                                    idem_body, snap.gateway.store.idempotency_ttl_s * 1000, held=held)
        except StoreUnavailable:
            log.error("request %s: settlement failed (store unavailable); the sweeper will settle it", rid)


class Sweeper:
    """Charges expired leases in full, marked ambiguous. Every worker sweeps; settlement is idempotent."""

    def __init__(self, store: Store, tenants: Callable[[], Iterable[str]], interval_s: float = 1.0):
        self.store, self.tenants, self.interval_s = store, tenants, interval_s

    async def sweep_once(self, now_ms: int | None = None) -> int:
        now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        settled = 0
        for tenant in self.tenants():
            for rid in await self.store.expired_leases(tenant, now_ms):
                held = await self.store.reservation(tenant, rid)
                if not held:
                    continue
                facts = json.loads(held.get("record") or "{}")
                record = {**facts, "termination": "unknown", "settlement": "ambiguous", "usage": None,
                          "attempts": [], "note": "lease expired before settlement: charged in full"}
                if await self.store.settle(tenant, rid, record, -1, -1, held=held) is not None:
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
