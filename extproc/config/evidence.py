"""What voids an evidence record besides its expiry (invariant 17: evidence is bound to what earned it).

- A changed artifact or adapter changes the fingerprint, so the record names another reference and
  qualifies nothing (the loader's warning says so).
- What produced it, each required: the digest of the corpus it ran (extproc/corpora/), of the code of
  the shape that translated it (extproc/shapes/<shape>/), and of the retry and fallback policy of the
  route it ran under. A record without them is bound to nothing and counts for nothing; one whose
  corpus or shape code changed since is void; one earned under another route policy qualifies only
  routes with that policy (Snapshot.passing_evidence).
- A quality gate is for one request class: void when the class no longer declares one, or its
  threshold rose above the record's score.
- Static triggers, checked at every load against the record's `basis`: the deployment's price
  version (a price change), the digest of its provider quota (a quota change), and the digest of
  what decides which data reaches the deployment - the data classes in their order, the deployment's
  own classes, the redaction settings (a policy change touching its data classes).
- Run-time triggers, each written as a void record (evidence/voids/) that voids every record of the
  fingerprint earned before it fired: provider drift, workload shift, SLO regression (`llmgw evidence
  reevaluate` from the ledger), a hosted deployment answering with another model (`model_mismatch`). A
  record earned after it lifts it: the candidate comes back by earning again, the same day included
  (records and voids carry the moment, not only the day; one dated by its day alone was earned at the
  day's start, and fired at its end). An engine that serves something other than its fingerprint
  declares (`engine_mismatch`, `llmgw engines verify`, a loop of `llmgw up`) voids every record while
  its void exists, whatever its date: it is about the engine now, and the check removes it once the
  engine serves what it declares.
- The latest record of a kind outranks the earlier ones: a failing re-run voids a passing record, and
  a passing run replaces a failed one (a record dated by its day alone loses a tie to a failing one).

A voided record is left out of qualification, so its candidate leaves routing; `llmgw check` and the
`llmgw_evidence_voided` gauge say which and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from extproc.config.schema import Deployment, Evidence, EvidenceBasis, EvidenceVoid, GatewayConfig, Route
from extproc.corpora import CONFORMANCE, digest_of, file_digest, quality_corpus
from extproc.shapes.registry import code_digest


def objectives_digest(gateway: GatewayConfig, classes: Iterable[str]) -> str:
    """The digest of these request classes' latency objectives (limits, attainment, peak rate) as
    configured now: a load record is void once any of them changed."""
    slos = {c: rc.slo.model_dump(mode="json") if (rc := gateway.request_classes.get(c)) and rc.slo else None
            for c in sorted(classes)}
    return digest_of(slos)


def corpus_path(kind: str, dep: Deployment, gateway: GatewayConfig, request_class: str,
                policy_dir: Path) -> Path | None:
    """The corpus a record of this kind is earned on now (None: a class without a quality gate; a load
    record's is its trace, the operator's)."""
    if kind == "load":
        return None
    if kind == "conformance":
        return CONFORMANCE[dep.serves]
    rc = gateway.request_classes.get(request_class)
    return quality_corpus(rc.quality.corpus, policy_dir) if rc is not None and rc.quality is not None else None


def basis_for(gateway: GatewayConfig, dep: Deployment, route: Route | None = None, corpus: Path | None = None
              ) -> EvidenceBasis:
    """The basis a record earned now for this deployment carries: what it was earned under, and what
    produced it (the corpus at `corpus`, this code's shape, `route`'s retry and fallback policy)."""
    return EvidenceBasis(
        corpus_digest=file_digest(corpus) if corpus is not None else None,
        shape_digest=code_digest(dep.fingerprint.adapter),
        route_policy_digest=route.policy_digest if route is not None else None,
        prices_version=dep.prices.version,
        quota_digest=digest_of(dep.provider_quota.agreed() if dep.provider_quota else None),
        policy_digest=digest_of({"data_classes": list(gateway.data_classes),
                               "deployment_data_classes": sorted(dep.data_classes),
                               "redaction": gateway.redaction.model_dump(mode="json")}))


TRIGGERS = (("prices_version", "price change"), ("quota_digest", "provider quota change"),
            ("policy_digest", "policy change touching its data classes"))


def static_voids(record: Evidence, dep: Deployment, gateway: GatewayConfig, policy_dir: Path) -> list[str]:
    """Why the record no longer holds under the configuration and code as they are now."""
    basis = record.basis
    if basis is None or not (basis.corpus_digest and basis.shape_digest and basis.route_policy_digest):
        return ["bound to nothing: it names no corpus, shape code or route policy digest (earn it with "
                "`llmgw conformance` / `llmgw evaluate`)"]
    if record.kind == "quality_gate" and (not record.request_class or record.score is None
                                          or record.threshold is None):
        return ["not graded: a quality gate names its request class, score and threshold (`llmgw evaluate`)"]
    now = basis_for(gateway, dep)
    out = []
    for field, trigger in TRIGGERS:
        was, is_ = getattr(basis, field), getattr(now, field)
        if was is not None and was != is_:
            out.append(f"{trigger} ({was} -> {is_})" if field == "prices_version" else trigger)
    if basis.shape_digest != now.shape_digest:
        out.append(f"the {dep.fingerprint.adapter} shape's code changed ({basis.shape_digest} -> {now.shape_digest})")
    if record.kind == "load":
        if record.load is None:
            return [*out, "not measured: a load record carries its figures (`llmgw bench sweep --evidence`)"]
        if record.load.objectives_digest != objectives_digest(gateway, record.load.classes):
            out.append(f"the objectives of {', '.join(sorted(record.load.classes))} changed")
        return out
    corpus = corpus_path(record.kind, dep, gateway, record.request_class, policy_dir)
    if corpus is None:
        out.append(f"request class {record.request_class!r} declares no quality gate now")
        return out
    digest = file_digest(corpus)
    if basis.corpus_digest != digest:
        out.append(f"its corpus changed ({basis.corpus_digest} -> {digest or f'{corpus.name} unreadable'})")
    rc = gateway.request_classes.get(record.request_class)
    if record.kind == "quality_gate" and rc is not None and rc.quality is not None and record.result == "pass" \
            and (record.score or 0.0) < rc.quality.threshold:
        out.append(f"the class's threshold {rc.quality.threshold} is above its score {record.score}")
    return out


# The engine check's trigger (llmgw/ops/engines.py): it holds while its void exists, whatever the records' age.
ENGINE_MISMATCH = "engine_mismatch"


def voids_record(void: EvidenceVoid, record: Evidence) -> bool:
    """Whether a run-time void holds against a record: one of its fingerprint earned before it fired
    (an engine mismatch: any, while it exists)."""
    return void.deployment_ref == record.deployment_ref and (
        void.trigger == ENGINE_MISMATCH or void.moment() >= record.moment())


def latest_per_kind(records: Iterable[Evidence]) -> list[Evidence]:
    """Of each kind (for one route policy and request class: Evidence.key), the latest record (at the
    same moment a failing one outranks a passing one)."""
    best: dict[tuple[str, str, str], Evidence] = {}
    for r in records:
        held = best.get(r.key())
        if held is None or (r.moment(), r.result == "fail") > (held.moment(), held.result == "fail"):
            best[r.key()] = r
    return list(best.values())


def sift(records: Mapping[str, Sequence[Evidence]], deployments: Mapping[str, Deployment], gateway: GatewayConfig,
         voids: Sequence[EvidenceVoid], policy_dir: Path
         ) -> tuple[dict[str, tuple[Evidence, ...]], dict[str, tuple[str, ...]], dict[str, frozenset[str]]]:
    """(the records that still count, by reference; why each reference lost records; the run-time
    triggers that voided some of them)."""
    by_ref = {d.ref: d for d in deployments.values()}
    kept: dict[str, tuple[Evidence, ...]] = {}
    voided: dict[str, tuple[str, ...]] = {}
    triggered: dict[str, frozenset[str]] = {}
    for ref, recs in records.items():
        dep = by_ref.get(ref)
        keep, why = [], []
        for r in latest_per_kind(recs):
            reasons = static_voids(r, dep, gateway, policy_dir) if dep is not None else []
            # A run-time trigger voids what was earned before it fired; an engine mismatch is about
            # the engine now, so it voids every record while its void exists (llmgw/ops/engines.py).
            fired = [v for v in voids if voids_record(v, r)]
            reasons += [f"{v.trigger.replace('_', ' ')}: {v.reason} ({v.recorded_at})" for v in fired]
            if fired:
                triggered[ref] = triggered.get(ref, frozenset()) | {v.trigger for v in fired}
            if reasons:
                why += [f"{r.kind}: {x}" for x in reasons]
            else:
                keep.append(r)
        kept[ref] = tuple(keep)
        if why:
            voided[ref] = tuple(why)
    return kept, voided, triggered
