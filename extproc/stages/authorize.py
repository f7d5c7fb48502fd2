"""Authorization, data-class part: the request's data class must be known and allowed for the tenant.

The Rego decision (tools, effects, obligations) lands with the identity and policy issue; this stage
already fails closed: no identity, no admission.
"""

from __future__ import annotations

from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange


class DataClassAuthorization:
    name = "authorize"

    async def run(self, ex: Exchange) -> None:
        if ex.identity is None:  # identity must have run; never admit without it
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no verified identity for this request")
        gw = ex.snapshot.gateway
        tenant = gw.tenants[ex.identity.tenant]
        requested = ex.headers.get("x-llmgw-data-class") or tenant.default_data_class
        if requested not in gw.data_classes:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"unknown data class {requested!r}",
                               "x-llmgw-data-class")
        if requested not in tenant.allowed_data_classes:
            raise GatewayError(ErrorCode.FORBIDDEN,
                               f"tenant may not send data class {requested!r}")
        ex.data_class = requested
