"""Intake: the request must be a chat completion (or an embeddings request, or a door's) whose body and
headers are well-formed (400 otherwise,
`unsupported_field` for what the gateway does not carry). The headers ext_proc reads are parsed here,
once, into the Exchange; later stages use the parsed values."""

from __future__ import annotations

from extproc import chat, client_fields, embeddings, headers, tracing
from extproc.contract import CHAT_PATH, EMBEDDINGS_PATH, ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.names import Header
from extproc.shapes.door import path_of
from extproc.shapes.loss import NAMESPACES, NATIVE
from extproc.shapes.registry import DOORS_BY_NAME


class Intake:
    name = "intake"

    async def run(self, ex: Exchange) -> None:
        door = DOORS_BY_NAME.get(ex.door)  # set from the path when the request arrived
        bare = path_of(ex.path)
        path = bare if door is not None else CHAT_PATH
        if bare == EMBEDDINGS_PATH and door is None:
            path, ex.operation = EMBEDDINGS_PATH, "embeddings"
        elif door is None and bare != CHAT_PATH:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, f"no such endpoint: {ex.method} {ex.path}")
        if ex.method != "POST":
            raise chat.invalid(f"{path} takes POST")
        limits = ex.snapshot.gateway.limits
        # Another API shape's request (and an embeddings request) becomes the internal one here; every
        # later stage sees one shape.
        ex.count = door is not None and door.counts(ex.path)
        if ex.operation == "embeddings":
            doc, ex.embedding = embeddings.request(ex.raw_body)
        elif ex.count and door is not None and door.count_request is not None:
            doc = door.count_request(ex.raw_body, ex.path)
        else:
            doc = door.request(ex.raw_body, ex.path) if door is not None else chat.parse_json(ex.raw_body)
        if ex.shadow_of is not None and isinstance(doc, dict):
            # A shadow copy is the body as the upstream got it: the served model's name, not the route's.
            doc["model"] = ex.shadow_of.route
        if isinstance(doc, dict):  # what the gateway answers itself leaves the request here
            ex.client_metadata = client_fields.take(doc).metadata
            if door is not None:  # a door's own fields: the route decides whether a plan can take them
                ex.native = doc.pop(NATIVE, None)
                ex.tool_namespaces = tuple(doc.pop(NAMESPACES, ()))
        ex.body = chat.validate(doc, limits.max_messages, limits.max_n)
        ex.stream = ex.body.get("stream") is True
        ex.n = ex.body.get("n") or 1
        ex.deadline_ms = headers.deadline_ms(ex.headers.get(Header.DEADLINE_MS))
        ex.idempotency_key = headers.idempotency_key(ex.headers.get(headers.IDEMPOTENCY_KEY))
        ex.traceparent, ex.tracestate = headers.trace_context(ex.headers.get(headers.TRACEPARENT),
                                                              ex.headers.get(headers.TRACESTATE))
        # The client's trace continued, or a new one; the gateway's span for the request is named now.
        ex.trace_id = ex.traceparent[3:35] if ex.traceparent else tracing.new_trace_id()
        ex.span_id = tracing.new_span_id()
