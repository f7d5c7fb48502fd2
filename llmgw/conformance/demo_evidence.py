"""Evidence for candidates that `llmgw up` itself simulates, earned when it is needed.

No evidence record in the repository carries a date: a committed record would expire on a fixed day and
take every demo route (and the test suite) down with it. Instead, before it serves, `llmgw up` looks at
each route candidate whose upstream it runs itself (a pool of simulated engines, a hosted deployment
served by a simulated provider) and, where that candidate has no passing record of a kind that stays
valid for RENEW_DAYS more:

- conformance: runs the corpus against it through a sandboxed gateway (`llmgw conformance`, measured,
  one sandbox per deployment, in parallel) and writes the record;
- quality_gate: writes an attestation saying what it is. A simulator's text is not graded (nothing in
  it is right or wrong), so the record attests the simulator, never a model.

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
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TextIO

import yaml

from extproc.config import Snapshot, load_snapshot
from extproc.config.evidence import basis_for
from extproc.config.loader import RECORD_DATE_GRACE
from extproc.config.schema import REQUIRED_EVIDENCE, Evidence
from llmgw.conformance.corpus import CORPORA, corpus_for
from llmgw.conformance.record import write_record
from llmgw.conformance.runner import Run, run

VALID_DAYS = 90  # how long a record written here stays valid
RENEW_DAYS = 14  # a record closer than this to its expiry is earned again
ATTESTATION = ("demo attestation written by llmgw up: the candidate is served by the simulator, whose text "
               "has nothing to grade")
ATTESTATION_HEADER = ("# Written by `llmgw up` for a candidate it simulates (llmgw/conformance/demo_evidence.py).\n"
                      "# It attests the simulator, not a model: real candidates need a quality gate their operator\n"
                      "# earns.\n")


def today_utc() -> date:
    return datetime.now(UTC).date()


def wanted(snap: Snapshot, simulated: Iterable[str], today: date) -> dict[str, set[str]]:
    """Each simulated route candidate's evidence kinds with no passing record valid RENEW_DAYS from now."""
    horizon = today + timedelta(days=RENEW_DAYS)
    candidates = {c.deployment_name for r in snap.routes.values() for c in r.candidates} & set(simulated)
    out = {}
    for name in sorted(candidates):
        missing = set(REQUIRED_EVIDENCE) - snap.passing_evidence(snap.deployments[name].ref, today, until=horizon)
        if missing:
            out[name] = missing
    return out


def _reusable(cached: Path, snap: Snapshot, name: str, corpus_version: str, today: date, horizon: date) -> bool:
    """Whether a cached conformance record is the one a run now would write: same fingerprint, adapter,
    corpus and basis, passing, not dated after today (a cache filled under a clock that ran ahead is
    earned again) and valid past the horizon."""
    try:
        record = Evidence.model_validate(yaml.safe_load(cached.read_text()))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    dep = snap.deployments[name]
    return (record.deployment_ref == dep.ref and record.result == "pass" and record.adapter == dep.fingerprint.adapter
            and record.corpus_version == corpus_version and record.basis == basis_for(snap.gateway, dep)
            and record.recorded_at <= today + RECORD_DATE_GRACE
            and record.expires_at is not None and record.expires_at > horizon)


def ensure(config: Path, simulated: Iterable[str], today: date | None = None, cache: Path | None = None,
           out: TextIO = sys.stdout, time_scale: float = 0.02,
           runner: Callable[..., Run] = run) -> list[Path]:
    """Earn or write what `wanted` finds for the policy at `config`; returns the records written. A
    conformance run that does not pass writes its failing record and raises RuntimeError: the demo
    must not start on a candidate the corpus failed."""
    if cache is not None:  # processes side by side (the suite's workers, sandboxes): one earns, the others reuse
        cache.mkdir(parents=True, exist_ok=True)
        with (cache / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _ensure(config, simulated, today or today_utc(), cache, out, time_scale, runner)
    return _ensure(config, simulated, today or today_utc(), cache, out, time_scale, runner)


def _ensure(config: Path, simulated: Iterable[str], today: date, cache: Path | None, out: TextIO,
            time_scale: float, runner: Callable[..., Run]) -> list[Path]:
    snap = load_snapshot(config)
    need = wanted(snap, simulated, today)
    horizon = today + timedelta(days=RENEW_DAYS)
    corpora = {serves: corpus_for(serves) for serves in CORPORA}  # by what the deployment serves
    written: list[Path] = []
    to_run = []
    for name in sorted(n for n, kinds in need.items() if "conformance" in kinds):
        cached = cache / f"{name}-conformance.yaml" if cache else None
        version = corpora[snap.deployments[name].serves].version
        if cached is not None and _reusable(cached, snap, name, version, today, horizon):
            (config / "evidence").mkdir(exist_ok=True)
            written.append(Path(shutil.copy(cached, config / "evidence" / cached.name)))
        else:
            to_run.append(name)
    if to_run:
        print(f"llmgw: earning conformance evidence for {', '.join(to_run)} (the corpus through a sandboxed "
              "gateway each; once, then again before it expires)", file=out, flush=True)

        def earn(name: str) -> tuple[str, Run]:
            with tempfile.TemporaryDirectory(prefix="llmgw-conformance-") as work:
                result = runner(config, name, corpora[snap.deployments[name].serves], Path(work), time_scale,
                                simulate_providers=True)
            # The run's compiled policies (regorus engines, bound to the thread that made them) are
            # collected here rather than by a later collection on another thread, which refuses them.
            gc.collect()
            return name, result

        with ThreadPoolExecutor(max_workers=len(to_run)) as pool:
            results = list(pool.map(earn, to_run))
        failed = []
        for name, result in results:
            path = write_record(config, snap, name, result, today, VALID_DAYS)
            written.append(path)
            if not result.passed:
                failed.append(name)
            elif cache is not None:  # made by ensure, under its lock
                shutil.copy(path, cache / path.name)
        if failed:
            raise RuntimeError(f"conformance failed for {', '.join(failed)} (see evidence/*-conformance.yaml)")
    for name in sorted(n for n, kinds in need.items() if "quality_gate" in kinds):
        path = config / "evidence" / f"{name}-quality-gate.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(ATTESTATION_HEADER + yaml.safe_dump({
            "deployment_ref": snap.deployments[name].ref, "kind": "quality_gate", "result": "pass",
            "recorded_at": today.isoformat(), "expires_at": (today + timedelta(days=VALID_DAYS)).isoformat(),
            "source": ATTESTATION,
            "basis": basis_for(snap.gateway, snap.deployments[name]).model_dump(mode="json"),
        }, sort_keys=False))
        written.append(path)
    return written


def simulated_by_up(snap: Snapshot, engine: str, simulate_providers: bool) -> set[str]:
    """The deployments a `llmgw up` with these options serves with simulators of its own."""
    from llmgw.render.bootstrap import simulated_providers

    pools = {n for n, d in snap.deployments.items() if d.pool} if engine == "sim" else set()
    hosted = {d.deployment for d in simulated_providers(snap)} if simulate_providers else set()
    return pools | hosted
