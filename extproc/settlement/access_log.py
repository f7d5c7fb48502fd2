"""Settlement from Envoy's gRPC access log: every admitted exchange is logged there, with the
io.llmgw metadata (usage included) and the exchange's fate; an entry is decoded into an Ending and
charged by the one rule (extproc/settlement/charge.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc

from extproc.config import Snapshot
from extproc.contract import METADATA_NAMESPACE
from extproc.envoy_msgs import attr, count_attr
from extproc.names import EXTPROC_FAILED, LEDGER_MARKS, PRICED_APART, USAGE_COUNTS, Header, Key, Settle, StreamEnd
from extproc.redact import log_safe, plain_id
from extproc.settlement.attempt_log import AttemptLog, attempt_end, is_attempt
from extproc.settlement.charge import (
    Ending,
    Timing,
    Usage,
    answered_by,
    charge_ending,
    earlier_charges,
    outcome_of,
)
from extproc.settlement.observe import REASON_LIMIT, SettledRequest, observer
from extproc.settlement.releases import decided_release, released
from extproc.settlement.settler import RETRY_EVERY_S, RETRY_FOR_S, Settler, store_down
from extproc.store import Settlement, StoreUnavailable, unanswered_bound

BACKSTOP_S = 2.0  # how long a stream's or idempotent answer's own filter has to settle it




class SettlementLog(als_grpc.AccessLogServiceServicer):
    """Envoy's gRPC access log: one long-lived stream, entries in batches, each carrying the io.llmgw
    metadata (usage included, by json_to_metadata) and the exchange's fate. Every admitted request
    is logged here."""

    def __init__(self, settler: Settler, snapshot: Callable[[], Snapshot]):
        self.settler = settler
        self.snapshot = snapshot
        self.entries = 0  # received, for GET /status
        self.attempts = AttemptLog()  # attempts that did not answer 2xx, until their request's entry
        self._pending: set[asyncio.Task[None]] = set()

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:
        async for msg in request_iterator:
            self.entries += len(msg.http_logs.log_entry)
            for entry in msg.http_logs.log_entry:
                try:
                    self.settle_entry(entry)
                except Exception:  # one bad entry must not end the stream of all the others
                    store_down.error("access log entry could not be settled", exc_info=True)
        return als_pb2.StreamAccessLogsResponse()

    def settle_entry(self, entry: Any) -> None:
        if is_attempt(entry):
            if (decoded := attempt_end(entry)) is not None:
                self.attempts.add(*decoded)
            return
        common = entry.common_properties
        md = common.metadata.filter_metadata.get(METADATA_NAMESPACE)
        undecided = md is None or not attr(md, Key.SETTLE)
        if undecided and entry.response.response_code_details.startswith(EXTPROC_FAILED):
            self._later(self._release_unprocessed(entry.request.request_id))
            return
        if md is None:
            return
        tenant, hint, rid = attr(md, Key.TENANT), attr(md, Key.HOLD), entry.request.request_id
        if not tenant or not hint or not rid:
            return
        status = entry.response.response_code.value
        flags = common.response_flags
        # A client that hung up once its stream's guard had passed [DONE] got the whole stream.
        cut = any(getattr(flags, name) for name in _CUT_FIELDS
                  if not (name == "downstream_connection_termination" and passed_done(md)))
        if attr(md, Key.SETTLE) == Settle.DECIDED:
            self.attempts.take(rid)  # (none: it was never dispatched)
            # The decision answered it itself (a refusal, a degraded answer): the worker that decided it
            # releases it. This is the backstop for a worker that died first, and it writes the same
            # entry, so the ledger says one thing whichever settles it (the first settlement wins).
            asyncio.get_running_loop().call_later(BACKSTOP_S, self._release_decided, entry, md, tenant, hint, rid)
            return
        if attr(md, Key.SETTLE) in _OWN_FILTER_SETTLES and 200 <= status < 300 and not cut:
            # An idempotent answer or stream that ended normally: its ext_proc filter settles it. This
            # is the backstop for a filter that could not (its worker died); the first settlement wins.
            asyncio.get_running_loop().call_later(BACKSTOP_S, self._settle, entry, md, tenant, hint, rid, True)
            return
        self._settle(entry, md, tenant, hint, rid, False)

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release_unprocessed(self, rid: str) -> None:
        """Envoy answered 503 itself: its decision never arrived (the worker was too slow, or died after
        it reserved). No upstream saw the request, so what a worker reserved for it is released now,
        not charged in full when its lease expires; the ledger entry says `not_processed`. The access
        log knows only the request's id: every tenant's reserve of it is marked refused first
        (Store.mark_unprocessed), then its tenant is found by the reservation it holds, if it holds one -
        a reserve still on its way when Envoy gave up holds nothing. A store that does not answer is
        asked again every RETRY_EVERY_S for RETRY_FOR_S, as settlements are."""
        if not rid:
            return
        give_up = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                held = await self.settler.store.mark_unprocessed(rid, list(self.snapshot().gateway.tenants))
                break
            except StoreUnavailable:
                if time.monotonic() >= give_up:
                    store_down.error("request %s: not released (store unavailable); its lease will expire", rid)
                    return
                await asyncio.sleep(RETRY_EVERY_S)
        if held is not None:
            tenant, hint = held
            self.settler.submit(Settlement(tenant, rid, released("not_processed", 503, ""), 0, 0, hint=hint))

    def _release_decided(self, entry: Any, md: Any, tenant: str, hint: str, rid: str) -> None:
        termination, extra = decided_release(entry.response.response_code_details, attr(md, Key.REFUSED_FIELD))
        outcome = released(termination, entry.response.response_code.value, attr(md, Key.ADMISSION), extra)
        self.settler.submit(Settlement(tenant, rid, outcome, 0, 0, hint=hint))

    def _settle(self, entry: Any, md: Any, tenant: str, hint: str, rid: str, backstop: bool) -> None:
        common = entry.common_properties
        snap = self.snapshot()
        dep = answered_by(snap, attr(md, Key.DEPLOYMENT), attr(md, Key.PLAN),
                          entry.response.response_headers.get(Header.DEPLOYMENT, ""))
        held = orjson.loads(hint)
        x = ending_of(entry, md, held, backstop)
        c = charge_ending(x, dep)
        count = common.upstream_request_attempt_count
        earlier, earlier_micros, earlier_tokens = earlier_charges(count, self.attempts.take(rid),
                                                                  unanswered_bound(held))
        marks = {k.value: attr(md, k) for k in LEDGER_MARKS}
        if c.degraded:
            marks[Key.DEGRADED.value] = "response"
        upstream = common.upstream_remote_address.socket_address
        first_byte = common.time_to_first_upstream_rx_byte
        def seconds(name: str) -> float | None:
            return getattr(common, name).ToNanoseconds() / 1e9 if common.HasField(name) else None
        start = common.start_time.ToNanoseconds() / 1e9 if common.HasField("start_time") else None
        token_at = attr(md, Key.FIRST_TOKEN_AT_US)  # the stream guard's stamp of the first content
        timing = Timing(seconds("time_to_last_downstream_tx_byte"), seconds("time_to_first_downstream_tx_byte"),
                        max(int(token_at) / 1e6 - start, 0.0) if token_at.isdigit() and start is not None else None)
        outcome = outcome_of(c.termination, x.status, c.kind, c.usage, c.source, dep,
                             attr(md, Key.REDACTIONS), {
                                 "upstream": f"{upstream.address}:{upstream.port_value}" if upstream.address else "",
                                 "count": count, **({"n": count} if count else {}),
                                 "first_byte_ms": round(first_byte.ToNanoseconds() / 1e6, 1) if x.answered else None,
                                 # the upstream's own status (Envoy may have replaced it for the client)
                                 **({"status": int(x.upstream_status)}
                                    if x.answered and x.upstream_status.isdigit() else {}),
                                 # what it said of its answer: its id for it, how a stream finished
                                 **{k.value: plain_id(v) for k in (Key.FINISH_REASON, Key.UPSTREAM_ID,
                                                                        Key.NATIVE_FINISH_REASON,
                                                                        Key.UPSTREAM_REQUEST_ID, Key.UPSTREAM_MODEL)
                                    if x.answered and (v := attr(md, k))},
                                 # translated by the decision (extproc/direct.py): what the translation lost
                                 **({"translation_loss": lost.split(", ")}
                                    if (lost := attr(md, Key.TRANSLATION_LOSS)) else {}),
                                 # why it refused the request (every entity redacted: the ledger keeps none)
                                 **({Key.UPSTREAM_MESSAGE.value: log_safe(reason, REASON_LIMIT)}
                                    if x.answered and (reason := attr(md, Key.UPSTREAM_MESSAGE)) else {})},
                             timing, marks)
        if x.count and x.usage:  # a token count: the number the caller got, beside (not as) usage
            outcome["counted_tokens"] = x.usage["prompt_tokens"]
        outcome["attempts"] = [*earlier, *outcome["attempts"]]
        observe = observer(SettledRequest(
            dep, attr(md, Key.ROUTE), x.stream, x.status, outcome, rid, attr(md, Key.TRACE), attr(md, Key.REVISION),
            start, timing, tenant if snap.gateway.metrics.tenant_label else ""))
        self.settler.submit(Settlement(tenant, rid, outcome, c.micros, c.tokens, hint=hint,
                                       earlier=(earlier_micros, earlier_tokens)), observe)


def logged_usage(md: Any, prompt: Any) -> Usage:
    """A usage object as Envoy's filters left it in the metadata, in the internal shape
    (extproc/names.py USAGE_COUNTS): a class the upstream did not report and that is priced apart is
    absent (a cache write, reasoning); any other count it did not give is 0."""
    usage: Usage = {}
    for key, path in USAGE_COUNTS:
        v = prompt if key is Key.USAGE_PROMPT else count_attr(md, key)
        if v is None and key in PRICED_APART:
            continue
        node = usage
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = 0 if v is None else v
    return usage


def ending_of(entry: Any, md: Any, held: dict[str, Any], backstop: bool) -> Ending:
    """An access-log entry decoded: the facts settlement decides the charge from (charge.Ending); `held`
    is the reservation's hint, decoded."""
    common = entry.common_properties
    flags = common.response_flags
    prompt = count_attr(md, Key.USAGE_PROMPT)  # present only when a filter found a usage object
    usage: Usage | None = None
    if prompt is not None:
        usage = logged_usage(md, prompt)
    chunks = attr(md, Key.STREAM_CHUNKS)
    return Ending(
        status=entry.response.response_code.value, stream=attr(md, Key.STREAM) == "1",
        prompt_bound=int(held.get("p", 0)), usage=usage, chunks=int(chunks) if chunks else 0,
        stream_done=passed_done(md), client_closed=flags.downstream_connection_termination,
        upstream_timeout=flags.upstream_request_timeout, backstop=backstop,
        broken=bool(attr(md, Key.ANSWER_BROKEN)), sent=common.HasField("time_to_first_upstream_tx_byte"),
        answered=common.HasField("time_to_first_upstream_rx_byte"), upstream_status=attr(md, Key.UPSTREAM_STATUS),
        degraded_response=entry.response.response_headers.get(Header.DEGRADED) == "response",
        count=bool(attr(md, Key.COUNT)))


def passed_done(md: Any) -> bool:
    """Whether the request's stream guard (Lua's or ext_proc's) passed the stream's normal end on."""
    return attr(md, Key.STREAM_END) == StreamEnd.DONE


# Settled by their own ext_proc filter, the access log being the backstop.
_OWN_FILTER_SETTLES = (Settle.METERED, Settle.KEPT_STREAM, Settle.CHECKED, Settle.CHECKED_STREAM)
# Envoy's response flags for an exchange that ended abnormally (UF, UC, UR, UPE, DC, DPE, UT, SI, UO,
# URX, UMSDR, UH, LR), as the access log's proto names them.
_CUT_FIELDS = ("upstream_connection_failure", "upstream_connection_termination", "upstream_remote_reset",
               "upstream_protocol_error",
               "downstream_connection_termination", "downstream_protocol_error", "upstream_request_timeout",
               "stream_idle_timeout", "upstream_overflow", "upstream_retry_limit_exceeded",
               "upstream_max_stream_duration_reached", "no_healthy_upstream", "local_reset")
