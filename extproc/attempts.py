"""The attempt filter: ext_proc as an upstream filter on a fallback route's sub-clusters, one stream
per attempt (extproc/fallback.py). Envoy's router owns the retries; this only addresses each one.

- Request headers: which candidate this attempt goes to - the plan ext_proc decided (the request's
  `plan` metadata: the tenant and the qualified candidates in order), the attempt number
  (`x-envoy-attempt-count`) and the cluster of the host Envoy chose (its metadata). A host that is no
  candidate of the plan is never sent to: 503 `no_qualified_route`, which Envoy does not retry. The
  candidate's credential, if it has one, is its authorization; otherwise there is none.
- Request body: the candidate's served model (the body was written for the first candidate).
- Response headers: `x-llmgw-deployment` names the candidate that answered.
- Each attempt is recorded in the store with its reservation, sent and then with its status, so the
  one ledger entry settlement writes lists every attempt, whichever ext_proc worker saw it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from extproc.config import Snapshot
from extproc.config.schema import Deployment
from extproc.contract import METADATA_NAMESPACE, ErrorCode, GatewayError
from extproc.fallback import attempt_kind, decode_plan
from extproc.secrets import SecretUnavailable, resolve
from extproc.settlement import ATTRIBUTES, attr, with_first
from extproc.store import Store, StoreUnavailable

log = logging.getLogger("llmgw.attempts")
HOST_CLUSTER = f"xds.upstream_host_metadata.filter_metadata['{METADATA_NAMESPACE}']['cluster']"
PLAN = f"metadata.filter_metadata['{METADATA_NAMESPACE}']['plan']"  # the request's, set by ext_proc's decision
ATTEMPT_ATTRIBUTES = (HOST_CLUSTER, PLAN, "request.id")


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def choose_candidate(snap: Snapshot, plan: list[str], attempt: int, host_cluster: str) -> int:
    """The plan's index of the candidate this attempt goes to. The composite cluster sends attempt n to
    candidate n (attempts beyond the last candidate to the last), or - when that one has no healthy
    host - to the next that has one: the first candidate from there on whose cluster is the host's."""
    for i in range(min(max(attempt, 1), len(plan)) - 1, len(plan)):
        dep = snap.deployments.get(plan[i])
        if dep is not None and snap.pool_of(dep) == host_cluster:
            return i
    raise GatewayError(ErrorCode.NO_QUALIFIED_ROUTE,
                       f"attempt {attempt} reached {host_cluster or 'an unknown host'}, which is no candidate "
                       "this request qualified for")


def body_for(body: bytes, dep: Deployment) -> bytes | None:
    """The request body addressed to this candidate; None when it already is."""
    doc = json.loads(body)
    if doc.get("model") == dep.served_model:
        return None
    doc["model"] = dep.served_model
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


class AttemptFilter:
    def __init__(self, store: Store | None, snapshot: Callable[[], Snapshot]):
        self.store = store
        self.snapshot = snapshot

    async def _record(self, tenant: str, rid: str, n: int, record: dict[str, Any]) -> None:
        if self.store is None or not tenant or not rid:
            return
        try:
            await self.store.record_attempt(tenant, rid, n, record)
        except StoreUnavailable:
            # The attempt still runs: settlement records what Envoy reported of the last one.
            log.error("request %s: attempt %d not recorded (store unavailable)", rid, n)

    async def handle(self, first: ep.ProcessingRequest,
                     rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingResponse]:
        snap = self.snapshot()
        headers: dict[str, str] = {}
        tenant = rid = ""
        n, dep, record, started = 1, None, {}, time.monotonic()
        async for req in with_first(first, rest):
            kind = req.WhichOneof("request")
            try:
                if kind == "request_headers":
                    for h in req.request_headers.headers.headers:
                        headers[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
                    attrs = req.attributes.get(ATTRIBUTES) if req.attributes else None
                    tenant, plan = decode_plan(attr(attrs, PLAN))
                    rid = attr(attrs, "request.id")
                    count = headers.get("x-envoy-attempt-count", "1")
                    n = int(count) if count.isdigit() else 1
                    index = choose_candidate(snap, plan, n, attr(attrs, HOST_CLUSTER))
                    dep = snap.deployments[plan[index]]
                    # The candidate the previous attempt went to (by the composite's order).
                    previous = snap.deployments.get(plan[min(n - 1, len(plan)) - 1]) if n > 1 else None
                    record = {"n": n, "deployment": dep.deployment, "adapter": dep.fingerprint.adapter,
                              "kind": attempt_kind(previous, dep), "status": 0}
                    # Retries reuse the request's headers: what an earlier attempt set for its candidate
                    # (a credential above all) must not reach this one.
                    mutation = ep.HeaderMutation()
                    if dep.credential_ref:
                        try:
                            token = resolve(dep.credential_ref, snap.directory)
                        except SecretUnavailable as e:
                            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, str(e)) from None
                        mutation.set_headers.append(_set("authorization", f"Bearer {token}"))
                    else:
                        mutation.remove_headers.append("authorization")
                    yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(
                        response=ep.CommonResponse(header_mutation=mutation)))
                elif kind == "request_body" and dep is not None:
                    common = ep.CommonResponse()
                    body = body_for(req.request_body.body, dep)
                    if body is not None:
                        common.body_mutation.body = body
                    length = len(body if body is not None else req.request_body.body)
                    common.header_mutation.set_headers.append(_set("content-length", str(length)))
                    # Recorded before it is sent: an attempt that never answers is in the ledger too.
                    await self._record(tenant, rid, n, record)
                    yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
                elif kind == "response_headers" and dep is not None:
                    status = next((h.raw_value.decode() or h.value for h in req.response_headers.headers.headers
                                   if h.key == ":status"), "0")
                    record.update(status=int(status) if status.isdigit() else 0,
                                  first_byte_ms=round((time.monotonic() - started) * 1000, 1))
                    await self._record(tenant, rid, n, record)
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
                        header_mutation=ep.HeaderMutation(set_headers=[_set("x-llmgw-deployment", dep.deployment)]))))
                    return
                else:
                    log.warning("attempt filter: unexpected message %s", kind)
                    return
            except GatewayError as err:  # final: Envoy does not retry an upstream filter's own reply
                yield _refusal(err)
                return
            except Exception:
                log.exception("attempt filter: request %s attempt %d", rid, n)
                yield _refusal(GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the gateway could not address this attempt"))
                return


def _refusal(err: GatewayError) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=err.status),
        headers=ep.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
        body=err.body(), details=f"llmgw_{err.code.value}"))
