"""The door filter: what a front door's caller receives, in its own shape (extproc/doors/).

It sits before the decision filter in Envoy's chain, so on the way out it sees every answer last:
the upstream's, translated to the internal shape and metered by the filters after it; the contract's
errors (ext_proc's refusals, Envoy's own replies, upstream errors rewritten by custom_response). Off
by default; the route a front door's path matches on arrival turns it on. Per request: the response
headers (status and content type: a stream is translated chunk by chunk, anything else once it is
whole), then the body.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.adapters.base import UpstreamBroken
from extproc.contract import ErrorCode
from extproc.doors import BY_NAME, Door, DoorStream, door_for
from extproc.envoy_msgs import ATTRIBUTES, MD, attr, header, md_attr, with_first
from extproc.names import Key
from extproc.ratelimit import RateLimitedLog

_PM = processing_mode_pb2.ProcessingMode
# Response headers, then the body chunk by chunk (a JSON answer is held until its end; most come in
# one chunk). Streamed from the start: with a mode chosen in the headers reply, Envoy checks a body
# that arrived whole before that reply against a content length it no longer lets the reply change.
DOOR_MODE = {"request_header_mode": _PM.SKIP, "request_body_mode": _PM.NONE, "response_header_mode": _PM.SEND,
             "response_body_mode": _PM.STREAMED, "request_trailer_mode": _PM.SKIP, "response_trailer_mode": _PM.SKIP}
DOOR_ATTRIBUTES = ("request.path", f"{MD}['{Key.DOOR}']")
_errors = RateLimitedLog(logging.getLogger("llmgw.doors"), every_s=10.0)


def translate_body(door: Door, status: int, body: bytes) -> bytes:
    """A whole (buffered) answer in the door's shape: a 2xx chat completion, or an error."""
    if not 200 <= status < 300:
        return door.error(status, body)
    try:
        return orjson.dumps(door.answer(orjson.loads(body)))
    except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError, IndexError, UpstreamBroken):
        _errors.warning("door %s: an answer that is not a chat completion (%d bytes)", door.name, len(body))
        return door.error(502, orjson.dumps({"error": {"message": "the upstream's answer could not be read",
                                                       "code": ErrorCode.UPSTREAM_ERROR.value}}))


class DoorFilter:
    async def handle(self, first: ep.ProcessingRequest,
                     rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        door: Door | None = None
        stream: DoorStream | None = None
        status, held = 0, bytearray()
        async for msg in with_first(first, rest):
            kind = msg.WhichOneof("request")
            if kind == "response_headers":
                attrs = msg.attributes.get(ATTRIBUTES) if msg.attributes else None
                # The decision names the door (an admitted request's path was rewritten for the
                # upstream by then); a reply made before any decision keeps the path it came with.
                door = BY_NAME.get(md_attr(attrs, Key.DOOR)) or door_for(attr(attrs, "request.path"))
                code = header(msg.response_headers.headers, ":status", "0")
                status = int(code) if code.isdigit() else 0
                # The caller's body has another length: Envoy frames it (chunked). Removed here, in
                # the headers reply, whether or not the body has already arrived whole.
                mutation = ep.HeaderMutation(remove_headers=["content-length"] if door is not None else [])
                if door is not None and status == 200 and header(msg.response_headers.headers, "content-type"
                                                                 ).startswith("text/event-stream"):
                    stream = door.stream()
                yield ep.ProcessingResponse(response_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(header_mutation=mutation)))
                if msg.response_headers.end_of_stream:
                    return
            elif kind == "response_body":
                body = msg.response_body
                if door is None:
                    out = body.body
                elif stream is not None:  # chunk by chunk
                    out = stream.feed(body.body) + (stream.finish() if body.end_of_stream else b"")
                else:  # a whole answer or error, translated once it is all here
                    held += body.body
                    out = translate_body(door, status, bytes(held)) if body.end_of_stream else b""
                yield ep.ProcessingResponse(response_body=ep.BodyResponse(
                    response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=out))))
                if body.end_of_stream:
                    return
            else:
                _errors.warning("door filter: unexpected message %s", kind)
                return
