"""ext_proc's stream guard, for streams with an Idempotency-Key: every chunk passes through here
before the client sees it, because what the client received is recorded for replay before its last
chunk reaches it (a store write). Every other stream is guarded in Envoy by the Lua stream guard
(extproc/lua/stream_guard.lua), which does the same per chunk without a round trip and leaves
settlement to the access log.

- Whole events only: a chunk boundary inside an event holds that part back until the rest arrives.
- The usage chunk the gateway asked for on the client's behalf (`stream_options.include_usage`) is
  withheld from that client; its usage settles the reservation exactly.
- A failure after the first byte (an upstream error event, a malformed event, an end without
  `[DONE]`) ends the client's stream with the contract's `stream_interrupted` event and no normal
  finish, and is recorded as `stream_interrupted`.
- A stream longer than its route's `max_stream_ms` ends the same way; at its next chunk the exchange
  is reset, so the engine stops generating.
- Each chunk names the route the caller asked for as its `model` (as the Lua guard does).
- With an Idempotency-Key, what the client received is kept for replay (extproc/replay.py): the last
  chunk is held until it is recorded and settled, so a repeat of the key is replayed, never run again.
- A stream Envoy cuts (reset, idle timeout, client gone) ends this exchange without an end of stream:
  the access log settles it with Envoy's reason (`client_cancel` when the client left) and the chunk
  count the guard kept in the request's metadata, as `partial`; the guard settles it itself only if
  that entry never comes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from extproc.answer_checks import CheckSpec, Failure, call_policy
from extproc.contract import METADATA_NAMESPACE, interrupted_event
from extproc.envoy_msgs import attr, md_attr, with_first
from extproc.names import INTERRUPTED, KEEPALIVE, MAX_EVENT_BYTES, Filter, Key, StreamEnd
from extproc.settlement.meter import Meter, answering
from extproc.sse import EventSplitter, StreamUsage, event_data
from extproc.stream_checks import AnswerFacts, StreamChecker

CUT_BACKSTOP_S = 2.0  # after a cut, how long the access log has to settle before the guard does


def is_chunk(obj: Any) -> bool:
    """A stream's event is a chunk: an object with a list of choices, or a usage chunk (as the Lua guard
    reads it)."""
    return isinstance(obj, dict) and (isinstance(obj.get("choices"), list) or "usage" in obj)


def as_route(event: bytes, obj: Any, route: str) -> bytes:
    """A chunk naming the route the caller asked for as its model (the served one is in the ledger)."""
    if not route or not isinstance(obj, dict) or not isinstance(obj.get("model"), str) or obj["model"] == route:
        return event
    return b"data: " + orjson.dumps({**obj, "model": route}) + b"\n\n"


class StreamGuard:
    def __init__(self, meter: Meter):
        self.meter = meter  # settles the same way the meter does

    async def guard(self, first: ep.ProcessingRequest,
                    rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        attrs = first.attributes.get(Filter.EXT_PROC) if first.attributes else None
        tenant, rid, hint = md_attr(attrs, Key.TENANT), attr(attrs, "request.id"), md_attr(attrs, Key.HOLD)
        route = md_attr(attrs, Key.ROUTE)
        withhold = md_attr(attrs, Key.WITHHOLD_USAGE) == "1"
        code = attr(attrs, "response.code")
        status = int(code) if code.isdigit() else 0
        first_at = time.time()  # the first message is the stream's first chunk (headers are skipped)
        token_at: float | None = None  # when its first content came: the time to first token
        usage, events = StreamUsage(), EventSplitter()
        broken, over, complete = "", "", False
        counted = 0
        ends_at_ms = md_attr(attrs, Key.STREAM_ENDS_AT_MS)
        ends_at = int(ends_at_ms) / 1000 if ends_at_ms.isdigit() else None

        # Envoy also runs this filter on replies ext_proc itself made (an idempotent replay, a refusal),
        # before any route chose it: only an admitted stream holding a reservation is guarded.
        guarded = bool(tenant and rid and hint) and md_attr(attrs, Key.STREAM) == "1"
        # A checked stream (extproc/stream_checks.py): its tool calls held until checked. Once the checks
        # refused it the client has its end; what the upstream still sends is read for its usage only.
        spec_text = md_attr(attrs, Key.CHECKS) if 200 <= status < 300 else ""
        snap = self.meter.snapshot()
        spec = CheckSpec.decode(spec_text).answered_by(answering(snap, attrs)) if spec_text else None
        checker = StreamChecker(spec, call_policy(snap.policy)) if spec is not None else None
        rejected: Failure | None = None
        answer = AnswerFacts()
        # With an Idempotency-Key: what the client receives, kept for replay (up to the limit, and a
        # byte more to know it went over).
        keep = self.meter.snapshot().gateway.store.idempotency_max_body_bytes + 1 \
            if guarded and orjson.loads(hint).get("i") else 0
        sent, settled, done_passed = bytearray(), False, False
        try:
            async for msg in with_first(first, rest):
                if msg.WhichOneof("request") != "response_body":
                    continue
                if not (guarded or checker) or not 200 <= status < 300:  # passes as it is (errors: contract's)
                    yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                    complete = complete or msg.response_body.end_of_stream
                    continue
                out = bytearray()
                if usage.error and over:
                    # The client has its event: reset the exchange, so the engine stops generating.
                    yield ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
                        status=http_status_pb2.HttpStatus(code=504), details="llmgw_max_stream_duration"))
                    break
                if not broken and ends_at is not None and time.time() > ends_at:
                    broken = over = INTERRUPTED[StreamEnd.OVER]
                if not broken:
                    for event in events.feed(msg.response_body.body):
                        data = event_data(event)
                        if data is None:
                            out += event
                            continue
                        try:
                            obj: Any = None if data.strip() == "[DONE]" else json.loads(data)
                        except ValueError:
                            broken = INTERRUPTED[StreamEnd.MALFORMED]
                            break
                        if isinstance(obj, dict) and "error" in obj:
                            broken = INTERRUPTED[StreamEnd.ERROR]
                            break
                        if data.strip() != "[DONE]" and not is_chunk(obj):
                            broken = INTERRUPTED[StreamEnd.MALFORMED]  # JSON, but no chunk
                            break
                        usage.observe(data)
                        answer.observe(obj)
                        if token_at is None and usage.content_chunks:
                            token_at = time.time()
                        if rejected is not None or (
                                withhold and isinstance(obj, dict) and obj.get("usage") and not obj.get("choices")):
                            continue  # the usage chunk the client did not ask for, or after a refusal
                        event = as_route(event, obj, route)
                        if checker is not None:
                            passed, failure = checker.feed(event, obj)
                            if failure is not None and checker.hold:
                                rejected = failure
                                out += interrupted_event(f"the answer failed the gateway's checks: {failure.text()}")
                                usage.error = True  # its end went out: nothing after it
                                continue
                            out += passed
                            continue
                        out += event
                    if not broken and events.pending > MAX_EVENT_BYTES:
                        broken = INTERRUPTED[StreamEnd.OVERSIZED]
                if msg.response_body.end_of_stream:
                    complete = True
                    if not broken and not usage.done and rejected is None:
                        broken = INTERRUPTED[StreamEnd.UNFINISHED]
                if broken and not usage.error:
                    usage.error = True  # recorded as stream_interrupted; the event goes out once
                    out += interrupted_event(broken)
                if keep and len(sent) < keep:
                    sent += out[:keep - len(sent)]
                if complete and keep and not broken:
                    # Recorded before the client has the end of the stream (and so before it can repeat).
                    settled = True
                    await self.meter.settle_stream(tenant, rid, hint, attrs, status, True, usage, first_at, bytes(sent),
                                                   answer.verdict(checker), token_at)
                passed = bytes(out) or (KEEPALIVE if not msg.response_body.end_of_stream and not usage.error else b"")
                reply = ep.ProcessingResponse(response_body=ep.BodyResponse(
                    response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=passed))))
                if usage.content_chunks != counted:
                    # What was generated so far, in the request's metadata: if Envoy cuts the stream,
                    # the access log settles it with this count and Envoy's reason (client gone or not).
                    moved: dict[str, Any] = {Key.STREAM_CHUNKS: usage.content_chunks}
                    if not counted and token_at is not None:  # the access log's TTFT, as the Lua guard's
                        moved[Key.FIRST_TOKEN_AT_US] = str(int(token_at * 1e6))
                    counted = usage.content_chunks
                    reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.update(moved)
                if usage.done and not broken and not done_passed and rejected is None:
                    # The client has the whole stream once this reply goes on: a client that hangs up
                    # right after [DONE] - before the upstream's own end reaches this guard - did not
                    # cancel, and the access log leaves the settlement to this guard.
                    done_passed = True
                    reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.update(
                        {Key.STREAM_END: StreamEnd.DONE.value})
                yield reply
                if complete:
                    break
        finally:
            if guarded and not settled:
                # [DONE] went on: the stream was whole, even if its end never came through here.
                whole = (complete or done_passed) and not broken
                settle = partial(self.meter.settle_stream, tenant, rid, hint, attrs, status, whole, usage,
                                 first_at, bytes(sent) if keep and whole else None,
                                 answer.verdict(checker), token_at)
                if complete or broken or done_passed:
                    settle()
                else:
                    # Envoy ended the exchange early (client gone, reset, idle timeout): its access
                    # log knows why and settles it; this settles only if that never comes (first wins).
                    asyncio.get_running_loop().call_later(CUT_BACKSTOP_S, settle)
