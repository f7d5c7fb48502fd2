"""Authorization: the Rego policy (package `llmgw.authz`) decides whether this caller may send this
data class to this route with these tools and effects, and which obligations (redaction, content
recording) apply. Default deny; any evaluation problem fails closed with 503 policy_unavailable.

The input document (documented in policy/README.md) carries no message content: policy decides on
who, what class, which route and which tools, never on the prompt text.
"""

from __future__ import annotations

from typing import Any

from extproc.answer_checks import Caller, spec_for
from extproc.bounds import requested_max_tokens
from extproc.config.policy import PolicyEvaluationError, cache_key
from extproc.config.schema import Route
from extproc.contract import ErrorCode, GatewayError
from extproc.decisions import DecisionRecorder, differences, log_entry, new_decision_id, result_of, sampled
from extproc.exchange import Exchange
from extproc.names import USER_AGENT, Header
from extproc.tool_catalog import ToolFacts, UnlistedRule


def unlisted_rule(ex: Exchange, route: Route) -> UnlistedRule:
    """The route's rule for tools no catalog entry lists, else the tenant's."""
    assert ex.identity is not None
    if route.unlisted_tools is not None:
        rule, by = route.unlisted_tools, f"route {route.route_contract}"
    else:
        rule, by = ex.snapshot.gateway.tenants[ex.identity.tenant].unlisted_tools, f"tenant {ex.identity.tenant}"
    return UnlistedRule(rule.rule, rule.effects, by)


def requested_tools(ex: Exchange, route: Route) -> list[ToolFacts]:
    """Each tool the request offers as the catalog resolves it for the request's client (unlisted: `known`
    false, with the unlisted rule's default effects when it admits). `tools` is the only field that
    offers tools: intake refuses the legacy `functions`."""
    catalog, rule = ex.snapshot.tools, unlisted_rule(ex, route)
    return [catalog.facts(t["function"]["name"], ex.client, rule) for t in ex.body.get("tools") or ()]


def policy_input(ex: Exchange, data_class: str, on: Route | None = None) -> dict[str, Any]:
    """The policy's input for this request on its route (or on `on`, another route)."""
    assert ex.identity is not None and ex.route is not None
    ident, route = ex.identity, on or ex.route
    tools = requested_tools(ex, route)
    return {
        "identity": {"tenant": ident.tenant, "subject": ident.subject, "kind": ident.kind,
                     "groups": list(ident.groups), "effects": list(ident.effects)},
        "request": {
            "route": route.route_contract, "request_class": route.request_class, "data_class": data_class,
            "model": ex.body["model"], "tools": [t.as_input() for t in tools], "stream": ex.stream,
            "client": ex.client, "unlisted_tools": unlisted_rule(ex, route).as_input(),
            "max_tokens": requested_max_tokens(ex.body, route.max_tokens_cap,
                                               ex.snapshot.gateway.limits.default_max_tokens),
            "idempotency_key": ex.idempotency_key is not None,
        },
        "route": {"name": route.route_contract, "request_class": route.request_class,
                  "record_content": route.telemetry.record_content},
        "candidates": [{"deployment": c.deployment_name, "data_classes": list(c.data_classes),
                        "regions": list(c.regions)} for c in route.candidates],
    }


def authorized_on(ex: Exchange, route: Route) -> bool:
    """Whether the policy allows this request on another route (a degraded route): the same caller,
    data class, tools and size, that route's name, class and candidates. Any evaluation problem: no."""
    if ex.snapshot.policy is None or ex.identity is None:
        return False
    doc = policy_input(ex, ex.data_class, route)
    try:
        return ex.snapshot.policy.decide(doc, cache_key(doc)).allow
    except PolicyEvaluationError:
        return False


class Authorization:
    name = "authorize"

    def __init__(self, recorder: DecisionRecorder | None = None):
        self.recorder = recorder  # the decision log and the dry run (extproc/decisions.py)

    async def run(self, ex: Exchange) -> None:
        if ex.identity is None:  # identity must have run; never admit without it
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no verified identity for this request")
        snap = ex.snapshot
        route = snap.routes.get(ex.body["model"])
        if route is None:
            raise GatewayError(ErrorCode.ROUTE_NOT_FOUND, f"no route named {ex.body['model']!r}", "model")
        ex.route = route
        if route.serves != ex.operation:  # an embeddings route takes POST /v1/embeddings only, and back
            where = "POST /v1/embeddings" if route.serves == "embeddings" else "chat completions (and the doors)"
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"route {route.route_contract!r} serves {route.serves}: "
                               f"send it to {where}", "model")
        residency = snap.gateway.tenants[ex.identity.tenant].regions
        if ex.region and residency is not None and ex.region not in residency:
            # The request would be processed here, outside the tenant's residency, before any upstream.
            raise GatewayError(ErrorCode.FORBIDDEN, f"this gateway runs in region {ex.region!r}, outside the tenant's "
                               f"residency ({', '.join(residency)}): use the gateway of one of those regions")
        data_class = ex.headers.get(Header.DATA_CLASS) or snap.gateway.tenants[ex.identity.tenant].default_data_class
        if data_class not in snap.gateway.data_classes:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "unknown data class", Header.DATA_CLASS)
        ex.data_class = data_class
        ex.client = snap.tools.client_of(ex.headers.get(USER_AGENT))
        if snap.policy is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorization policy is loaded")
        doc = policy_input(ex, data_class)
        ex.effects = tuple(sorted({e for t in doc["request"]["tools"] for e in t["effects"]}))
        ex.decision_id = new_decision_id()
        failure = ""
        key = cache_key(doc)
        try:
            ex.decision = snap.policy.decide(doc, key)
        except PolicyEvaluationError as e:
            failure = str(e)
        if self.recorder is not None:
            self._record(ex, doc, key, failure, self.recorder)
        if ex.decision is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the authorization policy could not be evaluated")
        if not ex.decision.allow:
            why = "; ".join(ex.decision.reasons) or "denied by policy"
            raise GatewayError(ErrorCode.FORBIDDEN, f"forbidden: {why}")
        if ex.operation == "chat" and not ex.count:  # what its answer will be held to (a bad schema: 400)
            ident = ex.identity
            ex.answer_checks = spec_for(ex.body, route.answer_checks, Caller(
                ident.tenant, ident.subject, ident.kind, tuple(ident.groups), tuple(ident.effects), data_class,
                route.route_contract, route.request_class), {t.name: t for t in requested_tools(ex, route)})

    @staticmethod
    def _record(ex: Exchange, doc: dict[str, Any], key: bytes, failure: str, recorder: DecisionRecorder) -> None:
        """The decision log entry, and the dry-run candidate's answer beside the enforced one: counted,
        and logged with both decision ids when they differ. Never changes what the request gets."""
        assert ex.identity is not None
        snap = ex.snapshot
        settings = snap.gateway.decision_log
        enforced = result_of(ex.decision, failure)
        entry = (log_entry(ex.decision_id, snap.revision, doc, enforced, settings.mask, ex.request_id)
                 if settings.enabled else None)
        candidate, dry = snap.dry_run_policy, snap.gateway.policy_dry_run
        if candidate is not None and dry is not None and sampled(ex.request_id, dry.sample):
            try:
                answer = result_of(candidate.decide(doc, key))
            except PolicyEvaluationError as e:
                answer = result_of(None, str(e))
            kinds = differences(enforced, answer)
            recorder.count_dry_run(candidate.revision, kinds)
            if kinds:
                entry = entry or log_entry(ex.decision_id, snap.revision, doc, enforced, settings.mask, ex.request_id)
                entry["dry_run"] = {"decision_id": new_decision_id(), "revision": candidate.revision,
                                    "result": answer, "differences": kinds}
        if entry is not None:
            recorder.log(ex.identity.tenant, entry)
