"""Re-evaluation triggers (issue 16, part 5): what voids an evidence record besides its expiry.

- A changed artifact or adapter changes the fingerprint, so the record names another reference and
  qualifies nothing (the loader's warning says so).
- Static triggers, checked at every load against the record's `basis`: the deployment's price
  version (a price change), the digest of its provider quota (a quota change), and the digest of
  what decides which data reaches the deployment - the data classes in their order, the deployment's
  own classes, the redaction settings (a policy change touching its data classes).
- Run-time triggers (`llmgw evidence reevaluate` from the ledger): provider drift, workload shift,
  SLO regression, each written as a void record (evidence/voids/) that voids every record of the
  fingerprint recorded on or before its date.
- A later failing record of a kind (a sampled re-run of the corpus that fails) outranks an earlier
  passing one.

A voided record is left out of qualification, so its candidate leaves routing; `llmgw check` and the
`llmgw_evidence_voided` gauge say which and why.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from extproc.config.schema import Deployment, Evidence, EvidenceBasis, EvidenceVoid, GatewayConfig


def _digest(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def basis_for(gateway: GatewayConfig, dep: Deployment) -> EvidenceBasis:
    """The basis a record earned now for this deployment carries."""
    return EvidenceBasis(
        prices_version=dep.prices.version,
        quota_digest=_digest(dep.provider_quota.model_dump(mode="json") if dep.provider_quota else None),
        policy_digest=_digest({"data_classes": list(gateway.data_classes),
                               "deployment_data_classes": sorted(dep.data_classes),
                               "redaction": gateway.redaction.model_dump(mode="json")}))


TRIGGERS = (("prices_version", "price change"), ("quota_digest", "provider quota change"),
            ("policy_digest", "policy change touching its data classes"))


def static_voids(record: Evidence, now: EvidenceBasis) -> list[str]:
    """Why the record no longer holds under the configuration as it is now."""
    if record.basis is None:
        return []
    out = []
    for field, trigger in TRIGGERS:
        was, is_ = getattr(record.basis, field), getattr(now, field)
        if was is not None and was != is_:
            out.append(f"{trigger} ({was} -> {is_})" if field == "prices_version" else trigger)
    return out


def latest_per_kind(records: Iterable[Evidence]) -> list[Evidence]:
    """Of each kind, the latest record (on the same day a failing one outranks a passing one)."""
    best: dict[str, Evidence] = {}
    for r in records:
        held = best.get(r.kind)
        if held is None or (r.recorded_at, r.result == "fail") > (held.recorded_at, held.result == "fail"):
            best[r.kind] = r
    return list(best.values())


def sift(records: Mapping[str, Sequence[Evidence]], deployments: Mapping[str, Deployment], gateway: GatewayConfig,
         voids: Sequence[EvidenceVoid]) -> tuple[dict[str, tuple[Evidence, ...]], dict[str, tuple[str, ...]]]:
    """(the records that still count, by reference; why each reference lost records)."""
    by_ref = {d.ref: d for d in deployments.values()}
    kept: dict[str, tuple[Evidence, ...]] = {}
    voided: dict[str, tuple[str, ...]] = {}
    for ref, recs in records.items():
        dep = by_ref.get(ref)
        now = basis_for(gateway, dep) if dep is not None else None
        keep, why = [], []
        for r in latest_per_kind(recs):
            reasons = static_voids(r, now) if now is not None else []
            reasons += [f"{v.trigger.replace('_', ' ')}: {v.reason} ({v.recorded_at})" for v in voids
                        if v.deployment_ref == ref and v.recorded_at >= r.recorded_at]
            if reasons:
                why += [f"{r.kind}: {x}" for x in reasons]
            else:
                keep.append(r)
        kept[ref] = tuple(keep)
        if why:
            voided[ref] = tuple(why)
    return kept, voided
