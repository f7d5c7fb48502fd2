"""`llmgw review`: a capacity and policy review's questions answered from the configuration and the last
measurements, as markdown.

1. KV memory per sequence at the p95 context length (each self-hosted deployment's model geometry:
   2 (K and V) x layers x KV heads x head dim x bytes per element, per token).
2. Utilisation at the latency SLO (from a sweep's results; not measured without one).
3. What happens when an accelerator type is unavailable: the routes that lose every candidate.
4. Which routes are policy-equivalent for each data class, and whether their candidates passed the
   same evaluation (the same conformance corpus, each with passing, unexpired evidence).
5. Who counts the tokens: the ledger, how its usage was sourced, and the reconciliation to run.
6. Deprecations: each `retire_at` with its date and what replaces it on each route.

A question the inputs cannot answer is answered "not measured" with what would measure it: never a
default that looks like a measurement.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date

from extproc.config import Snapshot
from extproc.config.schema import Deployment, ModelGeometry
from llmgw.ops import choice
from llmgw.ops.deprecations import replacement_problems

# The default example: a 70B-class model (80 layers, 8 KV heads of dimension 128, 16-bit KV).
EXAMPLE_70B = ModelGeometry(layers=80, kv_heads=8, head_dim=128, kv_bytes_per_element=2)
EXAMPLE_CONTEXT = 8_000


def kv_bytes_per_token(g: ModelGeometry) -> int:
    return 2 * g.layers * g.kv_heads * g.head_dim * g.kv_bytes_per_element


@dataclass(frozen=True)
class Measured:
    """What the last measurements say (None: not measured)."""

    p95_context_tokens: int | None = None  # prompt + completion, from the ledger
    context_source: str = ""
    slo_utilization: Mapping[str, float] | None = None  # pool -> utilisation where the SLO still held
    usage_sources: Mapping[str, int] | None = None  # ledger usage_source -> entries
    input_tokens: float = 1000.0  # the reference request candidates are priced for (per accepted task)
    output_tokens: float = 250.0


def _kv(snap: Snapshot, m: Measured) -> list[str]:
    per = kv_bytes_per_token(EXAMPLE_70B)
    out = ["## KV memory per sequence at the p95 context length", "",
           f"For scale: a 70B-class model at {per / 1024:.0f} KiB per token holds "
           f"{per * EXAMPLE_CONTEXT / 1e9:.1f} GB for one {EXAMPLE_CONTEXT:,}-token sequence.", ""]
    if m.p95_context_tokens is None:
        out.append("p95 context length: not measured (no ledger entries; pass --p95-context-tokens or run traffic).")
    else:
        out.append(f"p95 context length: {m.p95_context_tokens:,} tokens ({m.context_source}).")
    out.append("")
    for dep in sorted(snap.deployments.values(), key=lambda d: d.deployment):
        if dep.pool is None:
            continue
        if dep.model_geometry is None:
            out.append(f"- {dep.deployment}: not known - its deployment gives no `model_geometry`")
            continue
        b = kv_bytes_per_token(dep.model_geometry)
        at = f"; {b * m.p95_context_tokens / 1e9:.2f} GB at the p95 context" if m.p95_context_tokens else ""
        out.append(f"- {dep.deployment} ({dep.fingerprint.hardware}): {b / 1024:.0f} KiB per token{at}; "
                   f"{b * dep.context_window / 1e9:.1f} GB at its full context window ({dep.context_window:,})")
    return out


def _utilization(m: Measured) -> list[str]:
    out = ["", "## Utilisation at the latency SLO", ""]
    if not m.slo_utilization:
        out.append("Not measured: run `llmgw bench sweep` (open-loop, idle through saturation) and pass its "
                   "results with --sweep.")
    else:
        out += [f"- {pool}: {u:.0%}" for pool, u in sorted(m.slo_utilization.items())]
    return out


def _hardware(dep: Deployment) -> str:
    return dep.fingerprint.hardware if dep.pool else f"hosted:{dep.provider}"


def _unavailable(snap: Snapshot) -> list[str]:
    out = ["", "## When an accelerator type is unavailable", ""]
    kinds = sorted({_hardware(d) for d in snap.deployments.values()})
    for kind in kinds:
        lost: list[str] = []
        degraded: list[str] = []
        for name, route in sorted(snap.routes.items()):
            left = [c for c in route.candidates if _hardware(snap.deployments[c.deployment_name]) != kind]
            if not left:
                lost.append(name)
            elif len(left) < len(route.candidates):
                degraded.append(f"{name} (left: {', '.join(c.deployment_name for c in left)})")
        out.append(f"- {kind}: routes with no candidate left: {', '.join(lost) or 'none'}; routes that keep "
                   f"another: {', '.join(degraded) or 'none'}")
    return out


def _equivalence(snap: Snapshot, today: date) -> list[str]:
    out = ["", "## Policy-equivalent routes per data class, and their evaluation", ""]
    classes = snap.gateway.data_classes
    for dc in classes:
        routes = []
        for name, route in sorted(snap.routes.items()):
            cands = [c for c in route.candidates if dc in c.data_classes]
            if not cands:
                continue
            corpora = set()
            states = []
            for c in cands:
                records = [e for e in snap.evidence.get(c.deployment_ref, ()) if e.kind == "conformance"]
                corpora |= {e.corpus_version for e in records if e.corpus_version}
                missing = snap.missing_evidence(route, c.deployment_ref, today)
                states.append(f"{c.deployment_name} {'passes' if not missing else 'NOT qualified'}")
            same = ("the same corpus " + next(iter(corpora))) if len(corpora) == 1 else \
                ("DIFFERENT corpora: " + ", ".join(sorted(corpora)) if corpora else "no corpus recorded")
            routes.append(f"{name} [{'; '.join(states)}; {same}]")
        out.append(f"- {dc}: {', '.join(routes) or 'no route'}")
    return out


def _tokens(m: Measured) -> list[str]:
    out = ["", "## Who counts the tokens", "",
           "The gateway's ledger: one entry per authenticated request (unsampled), usage as the upstream "
           "reported it or, where it reported none, estimated and marked so; FOCUS rows come from it "
           "(`llmgw ledger export --format focus`)."]
    if m.usage_sources:
        total = sum(m.usage_sources.values())
        parts = ", ".join(f"{k}: {v} ({v / total:.0%})" for k, v in sorted(m.usage_sources.items()))
        out.append(f"Ledger entries by usage source: {parts}.")
    out.append("Reconciliation: `llmgw ledger reconcile --deployment D --invoice FILE` per hosted deployment; "
               "a day no invoice covers is an estimate.")
    return out


def _deprecations(snap: Snapshot, today: date) -> list[str]:
    out = ["", "## Deprecations (scheduled outages)", ""]
    routes_of: dict[str, list[str]] = defaultdict(list)
    for name, route in snap.routes.items():
        for c in route.candidates:
            routes_of[c.deployment_name].append(name)
    retiring = sorted((d for d in snap.deployments.values() if d.retire_at), key=lambda d: (d.retire_at, d.deployment))
    if not retiring:
        out.append("No deployment declares `retire_at`.")
    for dep in retiring:
        lines = []
        for name in sorted(routes_of[dep.deployment]):
            others = [c.deployment_name for c in snap.routes[name].candidates
                      if c.deployment_name != dep.deployment
                      and not snap.missing_evidence(snap.routes[name], c.deployment_ref, today)]
            lines.append(f"{name} -> {', '.join(others) if others else 'NO qualified replacement'}")
        assert dep.retire_at is not None
        passed = dep.retire_at <= today
        when = "passed" if passed else f"in {(dep.retire_at - today).days} days"
        problems = [] if passed else replacement_problems(snap, dep, today)
        declared = (f"owner {dep.retire_owner or 'NONE'}, replacement {dep.retire_replacement or 'NONE'}"
                    + ("" if passed else f" ({'; '.join(problems)})" if problems else " (qualified)"))
        out.append(f"- {dep.deployment}: retires {dep.retire_at} ({when}); {declared}; on its routes: "
                   f"{'; '.join(lines) if lines else 'none'}")
    return out


def review(snap: Snapshot, measured: Measured, today: date | None = None) -> str:
    today = today or date.today()
    parts: Sequence[str] = [f"# Review of revision {snap.revision} ({today})", "",
                            *_kv(snap, measured), *_utilization(measured), *_unavailable(snap),
                            *_equivalence(snap, today),
                            *choice.lines(snap, today, measured.input_tokens, measured.output_tokens),
                            *_tokens(measured), *_deprecations(snap, today)]
    return "\n".join(parts) + "\n"
