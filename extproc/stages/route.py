"""Routing: the `model` names a route contract; pick the first qualified candidate and address it:
the body names the deployment's served model and carries the tenant's prefix-cache salt.

Eligibility here (invariant 2): the candidate and its deployment serve the request's data class, the
deployment is neither withdrawn nor retired. Evidence, regions, context windows and fallback order land
with the routing issue.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from datetime import UTC, datetime

from extproc.config import Snapshot
from extproc.config.schema import Candidate, Deployment
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.picker import Picker


def tenant_salts(secret: str, tenants: Iterable[str]) -> dict[str, str]:
    """HMAC(secret, tenant): stable per tenant, unguessable without the secret, never shared."""
    return {t: hmac.new(secret.encode(), t.encode(), hashlib.sha256).hexdigest()[:32] for t in tenants}


class PickEndpoint:
    """Order the engines of the chosen pool by load and tenant-keyed prefix affinity."""

    name = "pick"

    def __init__(self, picker: Picker):
        self.picker = picker

    async def run(self, ex: Exchange) -> None:
        if ex.deployment is not None and ex.deployment.pool is not None:
            ex.endpoints = self.picker.pick(ex.deployment.pool, ex.cache_salt, ex.body.get("messages"))


def eligible(snap: Snapshot, cand: Candidate, data_class: str, today: datetime) -> Deployment | None:
    dep = snap.deployments.get(cand.deployment_name)
    if dep is None or dep.ref != cand.deployment_ref or dep.withdrawn:
        return None
    if dep.retire_at is not None and dep.retire_at <= today.date():
        return None
    if data_class not in cand.data_classes or data_class not in dep.data_classes:
        return None
    return dep


class RouteSelection:
    name = "route"

    async def run(self, ex: Exchange) -> None:
        snap = ex.snapshot
        route = snap.routes.get(ex.body["model"])
        if route is None:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, f"no route named {ex.body['model']!r}", "model")
        ex.route = route
        now = datetime.now(UTC)
        for cand in route.candidates:
            dep = eligible(snap, cand, ex.data_class, now)
            if dep is not None:
                break
        else:
            raise GatewayError(ErrorCode.NO_QUALIFIED_ROUTE,
                               f"no candidate of route {route.route_contract!r} qualifies for data class "
                               f"{ex.data_class!r}")
        ex.deployment = dep
        ex.cluster = snap.pool_of(dep)
        body = dict(ex.body)
        body["model"] = dep.served_model
        # Invariant 10: the prefix-cache salt is the tenant's, whatever the client sent.
        salt = ex.cache_salts.get(ex.identity.tenant) if ex.identity is not None else None
        if salt is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no prefix-cache salt for this tenant")
        body["cache_salt"] = ex.cache_salt = salt
        ex.upstream_body = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
