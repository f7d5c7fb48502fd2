"""The one place that turns Exchange results (and the attempt filter's) into Envoy ext_proc messages."""

from __future__ import annotations

import time
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.contract import DECISION_ID_HEADER, METADATA_NAMESPACE, REVISION_HEADER, GatewayError, degraded_body
from extproc.exchange import Exchange
from extproc.names import LB_KEY, LB_NAMESPACE, Header
from extproc.shapes.registry import DOORS_BY_NAME

_JSON = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def overwrite_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    """A header set whatever the message already holds (a retry reuses the request's headers)."""
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _metadata(values: dict[str, Any], endpoints: list[str] | None = None) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.fields[METADATA_NAMESPACE].struct_value.update(values)
    if endpoints:  # read by the pool cluster's override_host load-balancing policy
        md.fields[LB_NAMESPACE].struct_value.update({LB_KEY: ",".join(endpoints)})
    return md


def admit(ex: Exchange) -> ep.ProcessingResponse:
    """Let the buffered request continue to the cluster ext_proc chose: metadata the admitted route
    matches on, the route cache cleared so it is matched now, and the body as a stage rewrote it.
    With request headers SKIPped Envoy applies no header mutation here (per-request headers go through
    metadata), yet it clears the route cache only for a reply that carries one: hence the empty
    mutation. The buffer filter after ext_proc sets content-length for the new body."""
    body_mutation = ep.BodyMutation(body=ex.upstream_body) if ex.upstream_body is not None else None
    common = ep.CommonResponse(header_mutation=ep.HeaderMutation(), body_mutation=body_mutation,
                               clear_route_cache=True)
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                 dynamic_metadata=_metadata(ex.metadata(), ex.endpoints))


def longer_wait(seconds: float) -> ep.ProcessingResponse:
    """Envoy waits this long for the decision instead of its message timeout (the request is queued
    for admission): once per message, up to the filter's max_message_timeout."""
    wait = duration_pb2.Duration()
    wait.FromMilliseconds(max(1, round(seconds * 1000)))
    return ep.ProcessingResponse(override_message_timeout=wait)


# The response code details of the decision's own answers (Envoy's access log carries them): a refusal's
# is the prefix and its contract code; the settlement backstop names the ledger's entry from them.
REPLY_PREFIX = "llmgw_"
DEGRADED_DETAILS = REPLY_PREFIX + "degraded"


def immediate(ex: Exchange, status: int, body: bytes, details: str, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> ep.ProcessingResponse:
    """The decision's own answer, in place of an upstream's: whatever the request reserved, its worker
    releases (server.py), and the access log settles it only as the backstop (Settle.DECIDED)."""
    ex.replied = True
    hdrs = [_JSON if content_type == "application/json" else _header("content-type", content_type),
            _header(REVISION_HEADER, ex.snapshot.revision)]
    hdrs += [_header(k, v) for k, v in (headers or {}).items()]
    return ep.ProcessingResponse(immediate_response=_immediate_response(status, body, details, hdrs),
                                 dynamic_metadata=_metadata(ex.metadata()))


def _immediate_response(status: int, body: bytes, details: str,
                        headers: list[base_pb2.HeaderValueOption]) -> ep.ImmediateResponse:
    return ep.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status),
                                headers=ep.HeaderMutation(set_headers=headers), body=body, details=details)


def refuse(ex: Exchange, err: GatewayError) -> ep.ProcessingResponse:
    """End the exchange with the contract's JSON error. `details` starts with `llmgw` so Envoy's
    local-reply rewriting leaves this body alone."""
    headers = err.response_headers()
    if ex.decision_id:
        headers[DECISION_ID_HEADER] = ex.decision_id
    body = err.body(ex.decision_id)
    # Refused after routing chose a cluster (the completion left no room, no cache salt): no upstream
    # is reached, and custom_response must not take this reply for an upstream's error and rewrite it.
    ex.cluster = ""
    ex.refused_field = err.param or ""  # for the access log's backstop settlement (the ledger's `field`)
    if ex.door:  # in the caller's shape, the contract's code inside
        body = DOORS_BY_NAME[ex.door].error(err.status, body)
    return immediate(ex, err.status, body, REPLY_PREFIX + err.code.value, headers)


def refuse_answer(err: GatewayError, body: bytes, decision_id: str, revision: str) -> ep.ProcessingResponse:
    """A response filter's refusal of an answer it checked (the meter): the contract's error, `body`
    already in the caller's shape, in place of the upstream's answer."""
    headers = [_JSON, _header(REVISION_HEADER, revision),
               *((_header(DECISION_ID_HEADER, decision_id),) if decision_id else ()),
               *(_header(k, v) for k, v in err.response_headers().items())]
    return ep.ProcessingResponse(immediate_response=_immediate_response(
        err.status, body, f"llmgw_{err.code.value}", headers))


def refuse_attempt(err: GatewayError) -> ep.ProcessingResponse:
    """The attempt filter's refusal (an upstream filter has no Exchange): the contract's JSON error,
    marked as the gateway's own (Header.ATTEMPT_REFUSED) so that nothing downstream takes it for an
    upstream's error and rewrites it. Envoy does not retry an upstream filter's own reply."""
    return ep.ProcessingResponse(immediate_response=_immediate_response(
        err.status, err.body(), f"llmgw_{err.code.value}",
        [_JSON, _header(Header.ATTEMPT_REFUSED, "1"), *(_header(k, v) for k, v in err.response_headers().items())]))


def degraded_answer(ex: Exchange, text: str) -> ep.ProcessingResponse:
    """The route's fixed degraded answer (degraded_body). A front door's caller gets it in its own shape
    from the Lua door filter, which translates every answer on the way out."""
    assert ex.route is not None
    options = ex.body.get("stream_options")
    body = degraded_body(ex.route.route_contract, text, ex.request_id, int(time.time()), ex.stream,
                         bool(ex.door) or (isinstance(options, dict) and options.get("include_usage") is True))
    return immediate(ex, 200, body, DEGRADED_DETAILS, {Header.DEGRADED: "response"},
                     content_type="text/event-stream" if ex.stream else "application/json")
