"""Routing: the `model` names a route contract; its qualified candidates, in the route's order, are the
request's attempt plan (one: its own cluster; several: the composite cluster of exactly those, see
extproc/config/plans.py). The body names the first candidate's served model (the upstream filter rewrites
it for a fallback) and carries the tenant's prefix-cache salt.

Eligibility (invariant 2): the candidate and its deployment serve the request's data class and a
region the tenant allows; passing, unexpired evidence of every required kind exists for the exact
fingerprint; the deployment is neither withdrawn nor retired; and its context window holds the prompt's
upper bound (UTF-8 bytes + template allowance per message) plus max_tokens. A candidate may also take
only prompts of a size range (a pool for long prompts). None left: 400 context_length_exceeded when
the context window was the only reason; else the route's degraded answer when it declares one (a
fixed response, or its degraded route's candidates qualified the same way, where the policy allows
the request on that route); else 503 no_qualified_route - never open.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from typing import Any

import orjson

from extproc import embeddings
from extproc.bounds import completion_limit, inputs_fit, requested_max_tokens, template_allowance
from extproc.chat import prompt_bytes
from extproc.config import Snapshot
from extproc.config.plans import can_count, composite_name, decision_translates, uses_attempt_filter
from extproc.config.schema import Candidate, Deployment, Route
from extproc.contract import ErrorCode, GatewayError
from extproc.direct import count_request, native_request
from extproc.exchange import Exchange
from extproc.names import Settle
from extproc.picker import Picker
from extproc.shadow import Grant, issue, shadow_bucket
from extproc.shapes.loss import (
    CACHE_CONTROL,
    HINT_FIELDS,
    NATIVE,
    Loss,
    Support,
    cache_hinted,
    losses,
    without_cache_hints,
)
from extproc.shapes.registry import DOORS_BY_NAME, loss_table, shape_of
from extproc.stages.authorize import authorized_on


def tenant_salts(secret: str, tenants: Iterable[str]) -> dict[str, str]:
    """HMAC(secret, tenant): stable per tenant, unguessable without the secret, never shared."""
    return {t: hmac.new(secret.encode(), t.encode(), hashlib.sha256).hexdigest()[:32] for t in tenants}


class PickEndpoint:
    """Order the engines of the chosen pool by load and tenant-keyed prefix affinity; on a fallback
    plan, then each later candidate's pool. Envoy's override_host policy takes the list in order
    across attempts and skips addresses outside the attempt's cluster, so the attempt that falls back
    to candidate N starts at the best engine of candidate N's pool. Without fresh metrics for the first
    pool nothing is listed: attempt 1 would use up the others' addresses, and Envoy balances by itself."""

    name = "pick"

    def __init__(self, picker: Picker):
        self.picker = picker

    async def run(self, ex: Exchange) -> None:
        first = ex.deployment.pool if ex.deployment is not None else None
        if first is None:
            return
        messages = ex.body.get("messages")
        await self.picker.ensure_fresh()
        endpoints = self.picker.pick(first, ex.cache_salt, messages)
        pools = [first]
        for dep in ex.candidates[1:] if endpoints else ():
            if dep.pool is not None and dep.pool not in pools:
                pools.append(dep.pool)
                endpoints += self.picker.pick(dep.pool, ex.cache_salt, messages, record=False)
        ex.endpoints = endpoints


@dataclass(frozen=True)
class RequestFacts:
    """What qualification needs to know about the request."""

    data_class: str
    regions: tuple[str, ...] | None  # the tenant's residency; None = any region
    today: date
    prompt_bound: int  # upper bound on prompt tokens, before the per-message template allowance
    n_messages: int
    max_tokens: int


def disqualifications(snap: Snapshot, route: Route, cand: Candidate, req: RequestFacts) -> set[str]:
    """Every check this candidate fails (invariant 2 plus the context window); empty = eligible."""
    dep = snap.deployments.get(cand.deployment_name)
    if dep is None or dep.ref != cand.deployment_ref:
        return {"fingerprint"}
    failed = set()
    if dep.withdrawn:
        failed.add("withdrawn")
    if dep.retire_at is not None and dep.retire_at <= req.today:
        failed.add("retired")
    if req.data_class not in cand.data_classes or req.data_class not in dep.data_classes:
        failed.add("data_class")
    if req.regions is not None and not set(req.regions) & set(cand.regions) & set(dep.regions):
        failed.add("region")
    if snap.missing_evidence(route, dep.ref, req.today):
        failed.add("evidence")
        failed |= snap.void_triggers.get(dep.ref, frozenset())  # named: engine_mismatch, provider_drift, ...
    prompt = req.prompt_bound + dep.template_allowance_tokens * req.n_messages
    if prompt + req.max_tokens > dep.context_window:
        failed.add("context")
    if prompt < cand.min_prompt_tokens or (cand.max_prompt_tokens is not None and prompt > cand.max_prompt_tokens):
        failed.add("prompt_size")
    return failed


def rejects(route: Route, field: str, hint: bool) -> bool:
    """Whether losing `field` refuses the request on `route`: the route's rule for that field, else a
    hint's `report`, else the route's `translation_loss` (extproc/shapes/loss.py)."""
    rule = route.translation_loss_fields.get(field) or ("report" if hint else route.translation_loss)
    return rule == "reject"


def refused_losses(route: Route, lost: Iterable[Loss]) -> list[Loss]:
    """The unsupported fields this route refuses rather than reports."""
    return [x for x in lost if x.support is Support.UNSUPPORTED and rejects(route, x.field, x.field in HINT_FIELDS)]


def translation_check(dep: Deployment, body: dict[str, Any], route: Route) -> tuple[tuple[Loss, ...], set[str]]:
    """What this candidate's adapter loses of the request, and whether that disqualifies it
    (invariant 13): an unsupported field whose loss rule is `reject`."""
    lost = tuple(losses(body, loss_table(dep.fingerprint.adapter, dep.fingerprint.adapter_options)))
    return lost, {"translation_loss"} if refused_losses(route, lost) else set()


class Degraded(Exception):  # an outcome, like Replay, not an error
    """No candidate qualified and the route declares a fixed degraded answer: this text."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def qualify(snap: Snapshot, route: Route, facts: RequestFacts, body: dict[str, Any], rules: Route) -> tuple[
        list[int], dict[str, set[str]], dict[str, tuple[Loss, ...]]]:
    """(indices of the route's qualified candidates, each refused one's reasons, what each qualified
    one's adapter loses of the request)."""
    refused: dict[str, set[str]] = {}
    qualified: list[int] = []
    lost: dict[str, tuple[Loss, ...]] = {}
    for i, cand in enumerate(route.candidates):
        failed = disqualifications(snap, route, cand, facts)
        dep = snap.deployments.get(cand.deployment_name)
        if dep is not None and not failed:
            lost[dep.deployment], why = translation_check(dep, body, rules)
            failed |= why
        if failed:
            refused[cand.deployment_name] = failed
        else:
            qualified.append(i)
    return qualified, refused, lost


def shadow_plan(snap: Snapshot, route: Route, facts: RequestFacts, body: dict[str, Any],
                deployment: str) -> tuple[list[int], dict[str, set[str]], dict[str, tuple[Loss, ...]]]:
    """A shadow copy's plan: its candidate alone, if it qualifies for the request's data class, region,
    context and the route's loss rule. Evidence is not asked of it (the shadow gathers it)."""
    at = next((i for i, c in enumerate(route.candidates) if c.deployment_name == deployment), None)
    dep = snap.deployments.get(deployment)
    if at is None or dep is None:
        return [], {deployment: {"not_a_candidate"}}, {}
    failed = disqualifications(snap, route, route.candidates[at], facts) - {"evidence"}
    lost, why = translation_check(dep, body, route)
    if failed | why:
        return [], {deployment: failed | why}, {}
    return [at], {}, {deployment: lost}


def shadow_copy(ex: Exchange, route: Route, facts: RequestFacts) -> None:
    """Whether this admitted request is copied to the route's shadow candidate, and its grant if so: a
    chat completion offering no tool with effects, in the shadow's share, class and tenants, that the
    shadow candidate may receive (shadow_plan) and the tenant has a shadow budget for."""
    shadow, ident, snap = route.shadow, ex.identity, ex.snapshot
    if shadow is None or ident is None or ex.shadow_of is not None or ex.door or ex.effects or not ex.shadow_key:
        return
    if ((shadow.tenants and ident.tenant not in shadow.tenants)
            or (shadow.request_classes and route.request_class not in shadow.request_classes)
            or shadow_bucket(ex.request_id) >= shadow.share
            or ex.deployment is None or ex.deployment.deployment == shadow.deployment):
        return
    if not any(b.traffic == "shadow" and b.matches(ident.tenant, ident.subject, route.route_contract)
               for b in snap.gateway.budgets):
        return
    if not shadow_plan(snap, route, facts, ex.body, shadow.deployment)[0]:
        return
    ex.shadow = shadow.deployment
    ex.shadow_grant = issue(ex.shadow_key, Grant(
        of=ex.request_id, tenant=ident.tenant, subject=ident.subject, route=route.route_contract,
        data_class=ex.data_class, deployment=shadow.deployment, expires=time.time() + route.deadline_ms / 1000))


def canary_bucket(request_id: str) -> float:
    """Where a request falls in [0, 1): the same request id always falls in the same place."""
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 2**32


def canary_order(ex: Exchange, route: Route, qualified: list[int]) -> list[int]:
    """The canary first for its share of the requests it takes; out of every other request's plan
    while a stable candidate qualifies. Marks the exchange `canary` or `stable` for the ledger."""
    canary = route.canary
    assert canary is not None
    at = next(i for i, c in enumerate(route.candidates) if c.deployment_name == canary.deployment)
    tenant = ex.identity.tenant if ex.identity is not None else ""
    takes = ((not canary.tenants or tenant in canary.tenants)
             and (not canary.request_classes or route.request_class in canary.request_classes)
             and canary_bucket(ex.request_id) < canary.share)
    stable = [i for i in qualified if i != at]
    if takes and at in qualified:
        ex.canary = "canary"
        return [at, *stable]
    ex.canary = "stable"
    return stable or qualified


def native_plan(ex: Exchange, route: Route, lost: dict[str, tuple[Loss, ...]]) -> None:
    """A door's provider-only fields reach a plan only when every candidate it may try speaks the
    door's shape (they are sent as they came); otherwise each field's loss rule (rejects): `reject`
    refuses the request naming the first of them, `report` serves it without them and lists them as lost for each
    candidate of another shape."""
    assert ex.native is not None
    foreign = [d for d in ex.candidates if shape_of(d.fingerprint.adapter).name != ex.door]
    if not foreign:
        return
    names = list(ex.native)  # as the caller wrote them (a nested one dotted: generationConfig.thinkingConfig)
    door = DOORS_BY_NAME[ex.door]
    contracts = [n for n in names if rejects(route, n, door.is_hint(n))]  # a hint: dropped and reported
    if contracts:
        raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{contracts[0]}` is {ex.door}'s own and reaches only a "
                           f"{ex.door} candidate; this route may try {foreign[0].deployment}", contracts[0])
    for d in foreign:
        lost[d.deployment] = (*lost.get(d.deployment, ()),
                              *(Loss(k, Support.UNSUPPORTED, f"{ex.door}'s own") for k in names))
    ex.native = None


def keeps_cache_hints(dep: Deployment) -> bool:
    """Whether this candidate's adapter sends caching breakpoints on (in its shape or another)."""
    rule = loss_table(dep.fingerprint.adapter, dep.fingerprint.adapter_options).get(CACHE_CONTROL)
    return rule in (Support.SUPPORTED, Support.TRANSFORMED)


def count_plan(ex: Exchange, snap: Snapshot, route: Route, qualified: list[int]) -> None:
    """A token count: the route's first qualified candidate that can count (the engine's tokenizer, or
    its provider's own count) counts the prompt as it would see it; no other is tried."""
    counting = [snap.deployments[route.candidates[i].deployment_name] for i in qualified]
    dep = next((d for d in counting if can_count(d)), None)
    if dep is None:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"no candidate of route {route.route_contract!r} counts tokens")
    ex.candidates, ex.deployment = (dep,), dep
    ex.cluster = snap.pool_of(dep)
    body = {**ex.body, "model": dep.served_model}
    ex.upstream_body, ex.upstream_headers, ex.answer_shape = count_request(
        dep, body, ex.credentials, ex.credential_errors)


@dataclass(frozen=True)
class Planned:
    """The route stage's plan, for the stages after admission: the route whose candidates serve (this
    one, or its degraded route), the indices of the plan's candidates into it, the request's facts and
    what each candidate's adapter loses of it. Admission may drop the first candidates (no room)."""

    serving: Route
    qualified: tuple[int, ...]
    facts: RequestFacts
    lost: dict[str, tuple[Loss, ...]]

    def starting_at(self, k: int) -> Planned:
        return replace(self, qualified=self.qualified[k:])


class RouteSelection:
    name = "route"

    async def run(self, ex: Exchange) -> None:
        snap = ex.snapshot
        route = ex.route  # resolved by authorization, which needs the route's facts
        if route is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no authorized route for this request")
        tenant = snap.gateway.tenants.get(ex.identity.tenant) if ex.identity is not None else None
        # An embeddings request generates nothing, and each input is a sequence of its own: the
        # longest must fit the window. What redaction added must fit its reservation (invariant 3):
        # there is no completion to take it from.
        generates = ex.operation == "chat"
        if not generates:
            inputs_fit(ex.held, prompt_bytes(ex.body) + template_allowance(snap, route) * len(ex.body["messages"]))
        sized = ex.body if generates else embeddings.longest_input(ex.body)
        limit = requested_max_tokens(ex.body, route.max_tokens_cap, snap.gateway.limits.default_max_tokens)
        facts = RequestFacts(data_class=ex.data_class, regions=tenant.regions if tenant else None,
                             today=datetime.now(UTC).date(), prompt_bound=prompt_bytes(sized),
                             n_messages=len(sized.get("messages") or ()), max_tokens=limit if generates else 0)
        door = DOORS_BY_NAME.get(ex.door)  # a door's caller reads a loss named as it wrote the field
        serving = route  # the route whose candidates serve: this one, or its degraded route
        if ex.shadow_of is not None:
            qualified, refused, lost = shadow_plan(snap, route, facts, ex.body, ex.shadow_of.deployment)
        else:
            qualified, refused, lost = qualify(snap, route, facts, ex.body, route)
        ex.disqualified = "; ".join(f"{name}: {', '.join(sorted(f))}" for name, f in refused.items())
        if not qualified and ex.shadow_of is not None:
            raise GatewayError(ErrorCode.NO_QUALIFIED_ROUTE, f"the shadow candidate does not qualify ({refused})")
        if not qualified:
            reasons = ex.disqualified
            if all(f == {"context"} for f in refused.values()):
                raise GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                   "prompt and max_tokens exceed every eligible candidate's context window",
                                   "messages")
            if all(f == {"translation_loss"} for f in refused.values()):
                first = refused_losses(route, lost[route.candidates[0].deployment_name])[0]
                field = door.field_name(first.field) if door is not None else first.field
                raise GatewayError(ErrorCode.UNSUPPORTED_FIELD, f"`{field}` cannot be carried to this route's "
                                   f"provider ({first.note or 'no equivalent'})", field)
            degraded = route.degraded
            if degraded is not None and degraded.response is not None:
                raise Degraded(degraded.response)
            if degraded is not None and degraded.route is not None:
                serving = snap.routes[degraded.route]
                # The same checks for the request: the policy allows it on that route, and its candidates
                # qualify for this data class, region, evidence, context and loss rule.
                qualified, more, lost = qualify(snap, serving, facts, ex.body, route) \
                    if authorized_on(ex, serving) else ([], {degraded.route: {"forbidden"}}, {})
                refused |= more
                ex.disqualified = reasons = "; ".join(f"{name}: {', '.join(sorted(f))}" for name, f in refused.items())
                ex.degraded = f"route:{serving.route_contract}" if qualified else ""
            if not qualified:
                raise GatewayError(ErrorCode.NO_QUALIFIED_ROUTE,
                                   f"no candidate of route {route.route_contract!r} qualifies ({reasons})"
                                   + (f", nor of its degraded route {degraded.route!r}"
                                      if degraded is not None and degraded.route else ""))
        if serving is route and route.canary is not None and ex.shadow_of is None:  # a copy is neither side
            qualified = canary_order(ex, route, qualified)
        if not serving.fallback.enabled:
            qualified = qualified[:1]
        if ex.count:
            count_plan(ex, snap, serving, qualified)
            return
        ex.candidates = tuple(snap.deployments[serving.candidates[i].deployment_name] for i in qualified)
        ex.plan = Planned(serving, tuple(qualified), facts, lost)


class PlanRequest:
    """The upstream request for the plan admission left: its first candidate's cluster (or the
    composite cluster of the plan), the body as that candidate must receive it, the translation losses
    a caller is told of, and the shadow copy."""

    name = "plan"

    async def run(self, ex: Exchange) -> None:
        plan, route, snap = ex.plan, ex.route, ex.snapshot
        if plan is None or route is None:  # a token count: planned by the route stage
            return
        serving, qualified, facts, lost = plan.serving, list(plan.qualified), plan.facts, plan.lost
        door = DOORS_BY_NAME.get(ex.door)
        if ex.native:
            native_plan(ex, route, lost)
        # What a report-mode route lists (x-llmgw-translation-loss, the ledger), named as the caller wrote it.
        ex.translation_losses = {d.deployment: tuple(replace(x, field=door.field_name(x.field)) for x in found)
                                 if door is not None else found
                                 for d in ex.candidates if (found := lost.get(d.deployment))}
        if ex.answer_checks is not None and ex.answer_checks.format:
            # A candidate that serves without the response format (reported) is not held to it.
            unformatted = tuple(d.deployment for d in ex.candidates
                                if any(x.field == "response_format" for x in lost.get(d.deployment, ())))
            if len(unformatted) == len(ex.candidates) and not ex.answer_checks.tools:
                ex.answer_checks = None  # nothing left to check
            elif unformatted:
                ex.answer_checks = replace(ex.answer_checks, format_lost=unformatted)
        dep = ex.deployment = ex.candidates[0]
        if serving is route and route.shadow is not None:
            shadow_copy(ex, route, facts)
        # A lone candidate of another shape whose answer (JSON, or a stream) Envoy's Lua filter
        # translates: translated here, its own cluster (extproc/direct.py). Several qualified (or one
        # that needs its credential or translation otherwise): the composite cluster of exactly these,
        # tried in the route's order, behind the attempt filter.
        here = (len(ex.candidates) == 1 and decision_translates(dep) and not ex.door and not ex.shadow
                and ex.settled_by() in (Settle.ACCESS_LOG, Settle.STREAM, Settle.CHECKED, Settle.CHECKED_STREAM))
        ex.cluster = (composite_name(serving.route_contract, qualified)
                      if uses_attempt_filter(ex.candidates) and not here else snap.pool_of(dep))
        if ex.embedding is not None:  # the inputs as redaction left them, in the embeddings shape
            ex.upstream_body = orjson.dumps(embeddings.upstream_body(ex.body, ex.embedding, dep.served_model))
            return
        body = dict(ex.body)
        body["model"] = dep.served_model
        if ex.native:  # every candidate speaks the door's shape: its adapter sends them as they came
            body[NATIVE] = ex.native
        if cache_hinted(body) and not any(keeps_cache_hints(d) for d in ex.candidates):
            body = without_cache_hints(body)  # every candidate caches prompts on its own (emulated)
        # The bound the reservation holds is also the engine's (invariant 3).
        prompt_bound = facts.prompt_bound + template_allowance(snap, route) * facts.n_messages
        body["max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"] = (
            completion_limit(ex.held, facts.max_tokens, prompt_bound))
        # Invariant 10: the prefix-cache salt is the tenant's, whatever the client sent.
        salt = ex.cache_salts.get(ex.identity.tenant) if ex.identity is not None else None
        if salt is None:
            raise GatewayError(ErrorCode.POLICY_UNAVAILABLE, "no prefix-cache salt for this tenant")
        body["cache_salt"] = ex.cache_salt = salt
        if ex.stream and ex.held is not None:
            # Exact metering: ask for the usage chunk; the stream guard withholds it from a client that
            # did not ask for it (extproc/service/streams.py).
            given = body.get("stream_options")
            options: dict[str, Any] = given if isinstance(given, dict) else {}
            if options.get("include_usage") is not True:
                body["stream_options"] = {**options, "include_usage": True}
                ex.withhold_usage = True
        if here:
            ex.upstream_body, ex.upstream_headers, ex.answer_shape = native_request(
                dep, body, ex.credentials, ex.credential_errors, ex.stream)
        else:
            ex.upstream_body = orjson.dumps(body)
