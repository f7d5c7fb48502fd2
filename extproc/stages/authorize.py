"""Authorization: the Rego policy (package `llmgw.authz`) decides whether this caller may send this
data class to this route with these tools and effects, and which obligations (redaction, content
recording) apply. Default deny; any evaluation problem fails closed with 503 policy_unavailable.

The input document (documented in policy/README.md) carries no message content: policy decides on
who, what class, which route and which tools, never on the prompt text.
"""

from __future__ import annotations

from typing import Any

from extproc.bounds import requested_max_tokens
from extproc.config.policy import PolicyEvaluationError
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.headers import DATA_CLASS


def requested_tools(ex: Exchange) -> list[dict[str, Any]]:
    """Each tool the request offers, with its effects from the catalog (unknown: `known` false).
    `tools` is the only field that offers tools: intake refuses the legacy `functions`."""
    catalog = ex.snapshot.gateway.tools
    out = []
    for tool in ex.body.get("tools") or ():
        name = tool["function"]["name"]
        entry = catalog.get(name)
        out.append({"name": name, "known": entry is not None, "effects": list(entry.effects) if entry else []})
    return out


def policy_input(ex: Exchange, data_class: str) -> dict[str, Any]:
    assert ex.identity is not None and ex.route is not None
    ident, route = ex.identity, ex.route
    return {
        "identity": {"tenant": ident.tenant, "subject": ident.subject, "kind": ident.kind,
                     "groups": list(ident.groups), "effects": list(ident.effects)},
        "request": {
            "route": route.route_contract, "request_class": route.request_class, "data_class": data_class,
            "model": ex.body["model"], "tools": requested_tools(ex), "stream": ex.stream,
            "max_tokens": requested_max_tokens(ex.body, route.max_tokens_cap,
                                               ex.snapshot.gateway.limits.default_max_tokens),
            "idempotency_key": ex.idempotency_key is not None,
        },
        "route": {"name": route.route_contract, "request_class": route.request_class,
                  "record_content": route.telemetry.record_content},
        "candidates": [{"deployment": c.deployment_name, "data_classes": list(c.data_classes),
                        "regions": list(c.regions)} for c in route.candidates],
    }


class Authorization:
    name = "authorize"

    async def run(self, ex: Exchange) -> None:
        if ex.identity is None:  # identity must have run; never admit without it
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no verified identity for this request")
        snap = ex.snapshot
        route = snap.routes.get(ex.body["model"])
        if route is None:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, f"no route named {ex.body['model']!r}", "model")
        ex.route = route
        data_class = ex.headers.get(DATA_CLASS) or snap.gateway.tenants[ex.identity.tenant].default_data_class
        if data_class not in snap.gateway.data_classes:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "unknown data class", DATA_CLASS)
        ex.data_class = data_class
        if snap.policy is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorization policy is loaded")
        doc = policy_input(ex, data_class)
        ex.effects = tuple(sorted({e for t in doc["request"]["tools"] for e in t["effects"]}))
        try:
            ex.decision = snap.policy.decide(doc)
        except PolicyEvaluationError as e:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the authorization policy could not be evaluated") from e
        if not ex.decision.allow:
            why = "; ".join(ex.decision.reasons) or "denied by policy"
            raise GatewayError(ErrorCode.FORBIDDEN, f"forbidden: {why}")
