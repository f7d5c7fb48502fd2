"""Evidence for candidates that `llmgw up` itself simulates, earned when it is needed.

No evidence record in the repository carries a date: a committed record would expire on a fixed day and
take every demo route (and the test suite) down with it. Instead, before it serves, `llmgw up` looks at
each route candidate whose upstream it runs itself (a pool of simulated engines, a hosted deployment
served by a simulated provider) and, where that candidate has no passing record of a kind its route
requires that stays valid for RENEW_DAYS more, earns it: one sandboxed gateway per deployment (in
parallel), and in it, for each route policy the deployment is a candidate under (routes with the same
retry and fallback policy share records; quality gates also per request class),

- conformance: the corpus, as `llmgw conformance` runs it;
- quality_gate: the class's task-quality corpus, graded, as `llmgw evaluate` runs it. The simulators
  answer the tasks right on `sim_quality` of them, an operator's setting (`llmgw up --sim-quality`,
  default 1.0): the demo's gate is earned by a run that could fail, and does below the threshold.

A candidate served by anything else (real engines, a real provider) is never given evidence here: its
operator earns it. The test session does the same for its own policy copies (tests/conftest.py), with a
cache of records so that a second run of the suite does not earn them again.
"""

from __future__ import annotations

import fcntl
import gc
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import yaml

from extproc.config import Snapshot, load_snapshot
from extproc.config.evidence import ENGINE_MISMATCH, voids_record
from extproc.config.loader import RECORD_DATE_GRACE
from extproc.config.schema import Evidence, EvidenceBasis, Route
from extproc.corpora import quality_corpus
from llmgw.conformance.corpus import corpus_for
from llmgw.conformance.record import basis, record_path, write_record
from llmgw.conformance.runner import run_corpus, sandbox_faults, session
from llmgw.quality.corpus import load_quality
from llmgw.quality.evaluate import evaluate_in

VALID_DAYS = 90  # how long a record written here stays valid
RENEW_DAYS = 14  # a record closer than this to its expiry is earned again
SANDBOX_TRIES = 3  # runs of a candidate's earning while its sandbox fails cases itself (a loaded machine)


class SandboxNotReady(RuntimeError):
    """The sandbox never served a run whole: nothing is known of the candidate, and nothing was written."""


def today_utc() -> date:
    return datetime.now(UTC).date()


@dataclass(frozen=True)
class Earned:
    """One record a sandboxed run produced: under which route, its document (without its basis), the
    digest of the corpus it ran, and whether it passed."""

    route: str
    record: dict[str, Any]
    corpus_digest: str
    passed: bool
    sandbox_faults: tuple[str, ...] = ()  # cases the sandbox failed: the run says nothing of the candidate


def wanted(snap: Snapshot, simulated: Iterable[str], today: date) -> dict[str, dict[str, set[str]]]:
    """Each simulated candidate's missing kinds per route to earn them under (deployment -> route ->
    kinds): a record valid RENEW_DAYS from now is missing for that route, and no route earlier in the
    list earns the same one (same retry and fallback policy; for a quality gate, same class)."""
    horizon = today + timedelta(days=RENEW_DAYS)
    mine = set(simulated)
    out: dict[str, dict[str, set[str]]] = {}
    covered: set[tuple[str, str, str, str]] = set()
    for name, route in sorted(snap.routes.items()):
        for cand in route.candidates:
            if cand.deployment_name not in mine:
                continue
            for kind in sorted(snap.missing_evidence(route, snap.deployments[cand.deployment_name].ref, today,
                                                     until=horizon)):
                key = (cand.deployment_name, kind, route.policy_digest,
                       route.request_class if kind == "quality_gate" else "")
                if key not in covered:
                    covered.add(key)
                    out.setdefault(cand.deployment_name, {}).setdefault(name, set()).add(kind)
    return out


def _reusable(cached: Path, snap: Snapshot, name: str, route: Route, kind: str, today: date, horizon: date) -> bool:
    """Whether a cached record is the one a run now would write: same fingerprint, passing, bound to
    the same corpus, shape code, route policy and configuration, earned after every void of the
    policy's, not dated after today (a cache filled under a clock that ran ahead is earned again) and
    valid past the horizon."""
    try:
        record = Evidence.model_validate(yaml.safe_load(cached.read_text()))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    dep = snap.deployments[name]
    return (not any(voids_record(v, record) for v in snap.voids)
            and record.deployment_ref == dep.ref and record.kind == kind and record.result == "pass"
            and record.basis == EvidenceBasis.model_validate(basis(snap, dep, route, kind))
            and record.recorded_at <= today + RECORD_DATE_GRACE
            and record.expires_at is not None and record.expires_at > horizon)


def earn(config: Path, name: str, plan: dict[str, set[str]], work: Path, time_scale: float,
         sim_quality: float | None, today: date) -> list[Earned]:
    """`plan`'s records for deployment `name`, earned in one sandboxed gateway (see the module's doc)."""
    snap = load_snapshot(config)
    dep = snap.deployments[name]
    routes = [snap.routes[r] for r in sorted(plan)]
    conformance = corpus_for(dep.serves)
    qualities = {r.route_contract: load_quality(quality_corpus(q.corpus, snap.directory))
                 for r in routes if (q := snap.gateway.request_classes[r.request_class].quality) is not None}
    requests = [c.request for c in conformance.cases] + [t.request for q in qualities.values() for t in q.tasks]
    out = []
    with session(config, name, work, routes, requests, time_scale, simulate_providers=True,
                 sim_quality=sim_quality) as s:
        for route in routes:
            if "conformance" in plan[route.route_contract]:
                run = run_corpus(s, conformance, route.route_contract)
                out.append(Earned(route.route_contract, run.evidence(today, VALID_DAYS), run.corpus_digest,
                                  run.passed, tuple(sandbox_faults(run.results))))
            if "quality_gate" in plan[route.route_contract]:
                corpus = qualities[route.route_contract]
                threshold = snap.gateway.request_classes[route.request_class].quality.threshold  # type: ignore[union-attr]
                ev = evaluate_in(s, corpus, route, threshold)
                out.append(Earned(route.route_contract, ev.evidence(today, VALID_DAYS), corpus.digest, ev.passed,
                                  tuple(sandbox_faults(ev.results))))
    return out


def ensure(config: Path, simulated: Iterable[str], today: date | None = None, cache: Path | None = None,
           out: TextIO = sys.stdout, time_scale: float = 0.02, sim_quality: float | None = 1.0,
           earner: Callable[..., list[Earned]] = earn) -> list[Path]:
    """Earn what `wanted` finds for the policy at `config`; returns the records written. A run that
    does not pass writes its failing record and raises RuntimeError: the demo must not start on a
    candidate the corpus failed."""
    if cache is not None:  # processes side by side (the suite's workers, sandboxes): one earns, the others reuse
        cache.mkdir(parents=True, exist_ok=True)
        with (cache / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _ensure(config, simulated, today or today_utc(), cache, out, time_scale, sim_quality, earner)
    return _ensure(config, simulated, today or today_utc(), cache, out, time_scale, sim_quality, earner)


def _ensure(config: Path, simulated: Iterable[str], today: date, cache: Path | None, out: TextIO,
            time_scale: float, sim_quality: float | None, earner: Callable[..., list[Earned]]) -> list[Path]:
    # An engine mismatch is lifted by the engine check, not by earning (a run against engines that serve
    # another thing proves nothing of the fingerprint): what is missing is judged without its voids.
    snap = load_snapshot(config, unless=frozenset({ENGINE_MISMATCH}))
    horizon = today + timedelta(days=RENEW_DAYS)
    written: list[Path] = []
    to_run: dict[str, dict[str, set[str]]] = {}
    for name, plan in wanted(snap, simulated, today).items():
        for route_name, kinds in sorted(plan.items()):
            for kind in sorted(kinds):
                target = record_path(config, name, kind, route_name)
                cached = cache / target.name if cache else None
                if cached is not None and _reusable(cached, snap, name, snap.routes[route_name], kind, today, horizon):
                    target.parent.mkdir(exist_ok=True)
                    written.append(Path(shutil.copy(cached, target)))
                else:
                    to_run.setdefault(name, {}).setdefault(route_name, set()).add(kind)
    if not to_run:
        return written
    reasons = ", ".join(f"{n} ({why_earning(snap, n, to_run[n], today)})" for n in sorted(to_run))
    print(f"llmgw: earning evidence for {reasons} (conformance and quality corpora through a sandboxed gateway each)",
          file=out, flush=True)

    def run_one(name: str) -> tuple[str, list[Earned]]:
        for attempt in range(SANDBOX_TRIES):
            with tempfile.TemporaryDirectory(prefix="llmgw-evidence-") as work:
                result = earner(config, name, to_run[name], Path(work), time_scale, sim_quality, today)
            # The run's compiled policies (regorus engines, bound to the thread that made them) are
            # collected here rather than by a later collection on another thread, which refuses them.
            gc.collect()
            faults = sorted({c for e in result for c in e.sandbox_faults})
            if not faults:
                return name, result
            print(f"llmgw: the sandbox for {name} was not ready for {', '.join(faults[:5])} (a loaded machine, not a "
                  f"verdict on the candidate); {'earning again' if attempt + 1 < SANDBOX_TRIES else 'giving up'}",
                  file=out, flush=True)
        raise SandboxNotReady(f"the sandbox that earns {name}'s evidence did not serve it in {SANDBOX_TRIES} runs "
                              f"(cases {', '.join(faults[:5])}); nothing was recorded - try again on a quieter "
                              "machine: `llmgw demo-evidence`")

    with ThreadPoolExecutor(max_workers=len(to_run)) as pool:
        results = list(pool.map(run_one, sorted(to_run)))
    failed = []
    for name, earned in results:
        for e in earned:
            path = write_record(config, snap, name, snap.routes[e.route], e.record, e.corpus_digest)
            written.append(path)
            if not e.passed:
                cases = [f"{c['id']}: {c.get('detail', '')}" for c in e.record.get("cases", ())
                         if c["result"] == "fail"]
                failed.append(f"{name} ({e.record['kind']} on {e.route}: {'; '.join(cases[:5])})")
            elif cache is not None:  # made by ensure, under its lock
                shutil.copy(path, cache / path.name)
    if failed:
        raise RuntimeError(f"evidence failed for {', '.join(failed)} (see evidence/*.yaml)")
    return written


def why_earning(snap: Snapshot, name: str, plan: dict[str, set[str]], today: date) -> str:
    """Why a candidate's evidence is earned now, in a few words: voided (and by what), its latest run
    failed, expiring, or never earned."""
    dep = snap.deployments[name]
    if triggers := snap.void_triggers.get(dep.ref):
        return "voided: " + ", ".join(sorted(t.replace("_", " ") for t in triggers))
    if snap.voided.get(dep.ref):
        return "voided: " + snap.voided[dep.ref][0].split(": ", 1)[1][:80]
    routes = [snap.routes[r] for r in plan]
    held = [e for r in routes for e in snap.records_for(dep.ref, r) if e.kind in plan[r.route_contract]]
    if any(e.result == "fail" for e in held):
        return "its last run failed"
    if held:
        return f"expires within {RENEW_DAYS} days"
    return "none yet"


def simulated_by_up(snap: Snapshot, engine: str, simulate_providers: bool) -> set[str]:
    """The deployments a `llmgw up` with these options serves with simulators of its own."""
    from llmgw.render.bootstrap import simulated_providers

    pools = {n for n, d in snap.deployments.items() if d.pool} if engine == "sim" else set()
    hosted = {d.deployment for d in simulated_providers(snap)} if simulate_providers else set()
    return pools | hosted
