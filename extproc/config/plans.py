"""Fallback before the first byte (invariant 7): names shared by the renderer and the data plane.

A request whose route has more than one qualified candidate is sent to a composite cluster whose
sub-clusters are exactly those candidates, in the route's order: attempt 1 goes to the first, each
retry to the next, and once all were tried, to the last again (Envoy's `envoy.clusters.composite`).
A candidate with no healthy host is passed over within the attempt. One composite exists per ordered subset of a
route's candidates, so whichever candidates qualify for a request, the cluster it is sent to holds
no other: a candidate that failed qualification is never tried, not even as a fallback.

The composite's upstream filter chain holds ext_proc, which runs once per attempt
(extproc/service/attempts.py): it learns the candidate from the attempt plan and the chosen host, rewrites
the body for it, injects its credential and records the attempt.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from itertools import combinations

from extproc.config.schema import MAX_RETRIES, Deployment
from extproc.shapes.base import Target
from extproc.shapes.bedrock import adapter as bedrock
from extproc.shapes.registry import adapter_for, shape_of

MAX_ATTEMPTS = MAX_RETRIES + 1  # at least MAX_CANDIDATES: every candidate can be tried


def composite_name(route: str, indices: Sequence[int]) -> str:
    """The composite cluster for these candidates (indices into the route's list, in plan order:
    ascending, or a canary's first)."""
    return f"fallback_{route}_" + "_".join(str(i) for i in indices)


def needs_attempt_filter(dep: Deployment) -> bool:
    """A candidate with a credential (only the attempt filter injects it) or of another API shape (only
    the attempt filter translates) goes through the attempt filter even alone."""
    return dep.credential_ref is not None or translated(dep)


def translated(dep: Deployment) -> bool:
    """Whether the attempt filter speaks to this candidate through its adapter: another API shape, or
    a hosted OpenAI-shaped one (OpenAI, Azure) whose path, key header or honoured fields differ from
    the pool's."""
    return (dep.fingerprint.adapter.partition("@")[0] not in ("openai", "openai-compat")
            or dep.fingerprint.adapter_options.get("kind", "vllm") != "vllm")


def candidate_subsets(n: int, credentialed: Collection[int] = ()) -> Iterator[tuple[int, ...]]:
    """Every ordered subset of two or more of a route's n candidates, and each candidate that needs
    the attempt filter alone (`needs_attempt_filter`)."""
    for i in sorted(credentialed):
        yield (i,)
    for size in range(2, n + 1):
        yield from combinations(range(n), size)


def canary_orderings(n: int, canary: int) -> Iterator[tuple[int, ...]]:
    """A canary route's plans that put its canary first: the canary, then each ordered subset of the
    others (the plans without it first are among candidate_subsets')."""
    others = [i for i in range(n) if i != canary]
    for size in range(1, len(others) + 1):
        for rest in combinations(others, size):
            yield (canary, *rest)


def uses_attempt_filter(plan: Sequence[Deployment]) -> bool:
    return len(plan) > 1 or (len(plan) == 1 and needs_attempt_filter(plan[0]))


def sub_clusters(clusters: Sequence[str]) -> list[str]:
    """A composite's sub-clusters: attempt N goes to candidate N; attempts beyond the last candidate
    stay on it (transport retries), up to the most attempts a route may make."""
    return [*clusters, *[clusters[-1]] * (MAX_ATTEMPTS - len(clusters))]


def encode_plan(tenant: str, deployments: Sequence[str]) -> str:
    return f"{tenant};{','.join(deployments)}"


def decode_plan(value: str) -> tuple[str, list[str]]:
    tenant, _, deps = value.partition(";")
    return tenant, [d for d in deps.split(",") if d]


def attempt_kind(previous: Deployment | None, current: Deployment) -> str:
    """How the ledger tells attempts apart: the first; a transport retry (same deployment); a provider
    failover (another deployment of the same model); a model fallback (a different served system
    that the route lists under the same contract)."""
    if previous is None:
        return "first"
    if previous.deployment == current.deployment:
        return "transport_retry"
    if previous.fingerprint.model_digest == current.fingerprint.model_digest:
        return "provider_failover"
    return "model_fallback"


def decision_translates(dep: Deployment) -> bool:
    """Whether a request planned to this deployment alone may skip the attempt filter: its shape's
    answers are translated in Envoy's Lua answer filter (extproc/direct.py)."""
    return translated(dep) and shape_of(dep.fingerprint.adapter).lua_answers


def can_count(dep: Deployment) -> bool:
    """Whether `dep` counts a prompt's tokens (its provider's own count, or the engine's tokenizer): a
    door's token count is sent to it, its request's path and headers set by the Lua answer filter. A
    door's count is of a chat request: an embeddings deployment counts none."""
    return dep.serves == "chat" and adapter_for(dep.fingerprint.adapter).counts(
        Target(dep.served_model, "", dep.fingerprint.adapter_options))


def shape_headers(dep: Deployment) -> tuple[str, ...]:
    """The names of the headers this deployment's adapter sets on each request, its signature's
    included. The renderer keeps them off the route's removal list: the router applies it when it
    forwards, after the Lua filter has set them."""
    adapter = adapter_for(dep.fingerprint.adapter)
    _path, headers = adapter.endpoint(Target(dep.served_model, "credential", dep.fingerprint.adapter_options))
    signed = bedrock.SIGNED_HEADERS if adapter is bedrock.BEDROCK else ()
    return tuple(sorted({h.lower() for h in headers} | set(signed)))
