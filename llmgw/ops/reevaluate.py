"""`llmgw evidence reevaluate`: the run-time re-evaluation triggers, from the ledger (issue 16, part 5).

Over the last `window` of ledger entries, per deployment that answered them:
- provider drift: the share of its answers that failed upstream or broke mid-stream (a 5xx, an
  interrupted stream, a malformed answer) beyond a bound;
- SLO regression: its time to first byte p95 (streams) or end-to-end p95 (JSON) beyond a bound, or the
  share of a request class's answers within the class's objective (gateway.yaml request_classes) below
  the class's attainment;
- workload shift: the request-class mix moved (total variation distance between this window and the
  one before it) or the prompt lengths' p95 grew beyond a ratio - the evidence was earned for another
  workload.
Each finding is written as a void record (evidence/voids/ of the earned state), which the loader
applies to every evidence record of that fingerprint earned before it fired: the candidate leaves
routing until evidence is earned again (extproc/config/evidence.py). Too few requests decide nothing.

A deployment's window begins after its newest record was earned: the answers before it are about the
candidate that record replaced (yesterday's engine faults do not void the evidence earned this
morning, and a candidate earned again after a void is not voided at once by the answers that fired it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from extproc.config import Snapshot
from extproc.config.earned import voids_dir
from extproc.config.schema import Deployment, GatewayConfig
from llmgw.bench.stats import percentile
from llmgw.ops.ledger import ledger_entries, ttft_ms

BROKEN = {"stream_interrupted", "upstream_error"}


@dataclass(frozen=True)
class Bounds:
    max_failure_share: float = 0.05
    ttft_p95_ms: float | None = None
    e2e_p95_ms: float | None = None
    max_mix_shift: float = 0.2
    max_length_ratio: float = 1.5
    min_requests: int = 50
    # Per request class, from gateway.yaml (request_classes.<c>.slo): (TTFT limit ms, end-to-end limit
    # ms, the share of answers that must meet both). An answer of the class counts when within both.
    objectives: Mapping[str, tuple[float | None, float | None, float]] = field(default_factory=dict)


def windows(client: Any, tenants: Sequence[str], now: float, window_s: float, baseline_s: float
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ledger's entries of the last `window_s` seconds, and of the `baseline_s` before them."""
    start = now - window_s
    entries = ledger_entries(client, tenants, since=start - baseline_s)
    return ([e for e in entries if float(e.get("time") or 0) >= start],
            [e for e in entries if float(e.get("time") or 0) < start])


def after_earning(entries: Iterable[dict[str, Any]], snap: Snapshot) -> list[dict[str, Any]]:
    """The entries answered after the answering deployment's newest record was earned (Snapshot.earned)."""
    since = {name: snap.earned[d.ref].timestamp() for name, d in snap.deployments.items() if d.ref in snap.earned}
    return [e for e in entries if float(e.get("time") or 0) > since.get(_answered_by(e), 0.0)]


def objectives_of(gateway: GatewayConfig) -> dict[str, tuple[float | None, float | None, float]]:
    """Each request class's objective as the ledger can judge it (TTFT for streams, end to end)."""
    return {name: (rc.slo.ttft_ms, rc.slo.e2e_ms, rc.slo.attainment)
            for name, rc in gateway.request_classes.items() if rc.slo is not None}


def _within(entry: dict[str, Any], bound_ms: float | None, e2e_ms: float | None) -> bool:
    first, whole = ttft_ms(entry), entry.get("duration_ms")
    if bound_ms is not None and entry.get("stream") and (first is None or first > bound_ms):
        return False
    return e2e_ms is None or (whole is not None and float(whole) <= e2e_ms)


@dataclass(frozen=True)
class Finding:
    deployment: str
    trigger: str  # provider_drift | slo_regression | workload_shift
    reason: str


def _answered_by(entry: dict[str, Any]) -> str:
    attempts = entry.get("attempts") or []
    return str(attempts[-1].get("deployment") or "") if attempts else ""


def _failed(entry: dict[str, Any]) -> bool:
    attempts = entry.get("attempts") or [{}]
    return entry.get("termination") in BROKEN or int(attempts[-1].get("status") or 0) >= 500


def _prompt(entry: dict[str, Any]) -> float:
    usage = entry.get("usage") or {}
    return float(usage.get("prompt_tokens") or entry.get("prompt_bound") or 0)


def _mix(entries: Sequence[dict[str, Any]]) -> dict[str, float]:
    counts = Counter(str(e.get("request_class") or "") for e in entries)
    return {k: v / len(entries) for k, v in counts.items()} if entries else {}


def evaluate(window: Sequence[dict[str, Any]], before: Sequence[dict[str, Any]], bounds: Bounds) -> list[Finding]:
    """What fired, per deployment, over `window` (with `before` as the workload's baseline)."""
    out: list[Finding] = []
    served: dict[str, list[dict[str, Any]]] = {}
    for e in window:
        if dep := _answered_by(e):
            served.setdefault(dep, []).append(e)
    baseline: dict[str, list[dict[str, Any]]] = {}
    for e in before:
        if dep := _answered_by(e):
            baseline.setdefault(dep, []).append(e)
    for dep, entries in sorted(served.items()):
        n = len(entries)
        if n < bounds.min_requests:
            continue
        failed = sum(_failed(e) for e in entries) / n
        if failed > bounds.max_failure_share:
            out.append(Finding(dep, "provider_drift", f"{failed:.1%} of {n} answers failed or broke "
                                                      f"(bound {bounds.max_failure_share:.0%})"))
        ttft = [t for e in entries if e.get("stream") and (t := ttft_ms(e)) is not None]
        e2e = [float(e["duration_ms"]) for e in entries if not e.get("stream") and e.get("duration_ms") is not None]
        for name, values, bound in (("TTFT", ttft, bounds.ttft_p95_ms), ("E2E", e2e, bounds.e2e_p95_ms)):
            if bound is not None and len(values) >= bounds.min_requests and (p := percentile(values, 95)) > bound:
                out.append(Finding(dep, "slo_regression", f"{name} p95 {p:.0f} ms over {len(values)} answers "
                                                          f"(bound {bound:.0f} ms)"))
        for cls, (ttft_bound, e2e_ms, share) in sorted(bounds.objectives.items()):
            mine = [e for e in entries if e.get("request_class") == cls]
            met = sum(_within(e, ttft_bound, e2e_ms) for e in mine) / len(mine) if mine else 1.0
            if len(mine) >= bounds.min_requests and met < share:
                out.append(Finding(dep, "slo_regression", f"{cls}: {met:.1%} of {len(mine)} answers within its "
                                                          f"objective (at least {share:.0%})"))
        old = baseline.get(dep, [])
        if len(old) < bounds.min_requests:
            continue
        now_mix, old_mix = _mix(entries), _mix(old)
        shift = sum(abs(now_mix.get(k, 0.0) - old_mix.get(k, 0.0)) for k in set(now_mix) | set(old_mix)) / 2
        if shift > bounds.max_mix_shift:
            out.append(Finding(dep, "workload_shift", f"request-class mix moved by {shift:.2f} (total variation; "
                                                      f"bound {bounds.max_mix_shift})"))
        p_now, p_old = percentile([_prompt(e) for e in entries], 95), percentile([_prompt(e) for e in old], 95)
        if p_old > 0 and p_now / p_old > bounds.max_length_ratio:
            out.append(Finding(dep, "workload_shift", f"prompt p95 {p_now:.0f} tokens against {p_old:.0f} before "
                                                      f"(ratio bound {bounds.max_length_ratio})"))
    return out


def void_files(findings: Iterable[Finding], deployments: dict[str, Deployment], directory: Path,
               now: datetime) -> list[Path]:
    """Each finding as a void of its deployment, one file a trigger a day (a later finding the same day
    rewrites it with its own moment)."""
    written = []
    for f in findings:
        dep = deployments.get(f.deployment)
        if dep is None:
            continue
        written.append(write_void(directory, f"{f.deployment}-{f.trigger}-{now.date().isoformat()}.yaml",
                                  dep.ref, f.trigger, f.reason, now))
    return written


def write_void(directory: Path, name: str, ref: str, trigger: str, reason: str, now: datetime,
               header: str = "") -> Path:
    """A run-time void for the policy at `directory`, in its earned state (extproc/config/earned.py),
    dated by its day and the moment it fired."""
    path = voids_dir(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump({"deployment_ref": ref, "trigger": trigger, "reason": reason,
                                             "recorded_at": now.date().isoformat(),
                                             "voided_at": now.isoformat(timespec="seconds")}, sort_keys=False))
    return path
