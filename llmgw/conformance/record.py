"""Evidence records as files: where a record of a deployment, kind and route lives in the policy
directory, the basis it carries (what it was earned under and what produced it:
extproc/config/evidence.py), and the provisional records a sandbox gives its candidate."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from extproc.config import Snapshot, load_snapshot
from extproc.config.earned import earned_dir
from extproc.config.evidence import basis_for, corpus_path
from extproc.config.schema import Deployment, Route, required_evidence

CONFORMANCE_HEADER = (
    "# Written by `llmgw conformance` (llmgw/conformance/): the corpus run against this exact\n"
    "# fingerprint through a gateway, under the retry and fallback policy of the route it names. Re-run\n"
    "# it, do not edit it: a change to the fingerprint, the shape's code, the corpus or the route's policy\n"
    "# voids it.\n")
QUALITY_HEADER = (
    "# Written by `llmgw evaluate` (llmgw/quality/): the request class's task-quality corpus run against\n"
    "# this exact fingerprint through a gateway, graded by code. Re-run it, do not edit it: a change to the\n"
    "# fingerprint, the shape's code, the corpus or the route's policy voids it.\n")


def record_path(config: Path, deployment: str, kind: str, route: str) -> Path:
    """`<deployment>-<kind>-<route>.yaml` where the policy at `config` keeps what is earned
    (extproc/config/earned.py): one record per route it was earned on (a record qualifies every route
    with the same retry and fallback policy; a quality gate, of the same class)."""
    return earned_dir(config) / f"{deployment}-{kind.replace('_', '-')}-{route}.yaml"


def basis(snap: Snapshot, dep: Deployment, route: Route, kind: str) -> dict[str, Any]:
    """The basis a record of `kind` earned now under `route` carries."""
    corpus = corpus_path(kind, dep, snap.gateway, route.request_class, snap.directory)
    return basis_for(snap.gateway, dep, route, corpus).model_dump(mode="json")


def provisional(snap: Snapshot, dep: Deployment, route: Route, today: date) -> dict[str, dict[str, Any]]:
    """Passing records of every kind `route` requires, bound as earned ones are: what a sandbox gives
    the candidate under test (it is routed to only there), and a benchmark its simulated candidates."""
    out = {}
    for kind in sorted(required_evidence(snap.gateway, route)):
        doc: dict[str, Any] = {"deployment_ref": dep.ref, "kind": kind, "result": "pass",
                               "recorded_at": today.isoformat(), "source": "provisional: a sandbox or benchmark only",
                               "route": route.route_contract, "basis": basis(snap, dep, route, kind)}
        rc = snap.gateway.request_classes[route.request_class]
        if kind == "quality_gate" and rc.quality is not None:
            doc.update(request_class=route.request_class, score=1.0, threshold=rc.quality.threshold)
        out[kind] = doc
    return out


def write_record(config: Path, snap: Snapshot, deployment: str, route: Route, record: dict[str, Any],
                 corpus_digest: str) -> Path:
    """`record` (a run's, without its basis) written with the basis it was earned under: the digest of
    the corpus it ran (a corpus other than the one its kind needs now leaves it void), this code's
    shape, `route`'s policy - and the moment it was earned (a void that fired before it is lifted)."""
    kind = record["kind"]
    path = record_path(config, deployment, kind, route.route_contract)
    earned = {**basis(snap, snap.deployments[deployment], route, kind), "corpus_digest": corpus_digest}
    doc = {**record, "earned_at": record.get("earned_at") or datetime.now(UTC).isoformat(timespec="seconds"),
           "route": route.route_contract, "basis": earned}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((CONFORMANCE_HEADER if kind == "conformance" else QUALITY_HEADER)
                    + yaml.safe_dump(doc, sort_keys=False))
    return path


def stamp(config: Path, deployment: str, today: date, valid_days: int = 30) -> list[Path]:
    """Provisional passing records for `deployment` under every route that has it as a candidate,
    written into the policy at `config`: for a benchmark's or a test's simulated candidate whose
    evidence is not what it measures. Never for a candidate a user routes to: evidence is earned."""
    snap = load_snapshot(config)
    dep = snap.deployments[deployment]
    written = []
    for name, route in sorted(snap.routes.items()):
        if not any(c.deployment_name == deployment for c in route.candidates):
            continue
        for kind, doc in provisional(snap, dep, route, today).items():
            path = record_path(config, deployment, kind, name)
            path.parent.mkdir(exist_ok=True)
            path.write_text(yaml.safe_dump({**doc, "expires_at": (today + timedelta(days=valid_days)).isoformat()}))
            written.append(path)
    return written
