"""`llmgw evaluate`'s run: a request class's task-quality corpus sent to one candidate through a
sandboxed gateway (the conformance runner's sandbox: llmgw/conformance/runner.py), each answer graded
by code (llmgw/quality/scorers.py), the share answered right compared with the class's threshold."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

from extproc.config.schema import Route
from llmgw.conformance.runner import CaseResult, Session, sandbox_failed, send
from llmgw.quality.corpus import QualityCorpus
from llmgw.quality.scorers import grade

SOURCE = "llmgw evaluate"


@dataclass
class Evaluation:
    deployment_ref: str
    adapter: str
    request_class: str
    corpus_version: str
    corpus_digest: str
    threshold: float
    results: list[CaseResult] = field(default_factory=list)

    @property
    def score(self) -> float:
        return round(sum(r.result == "pass" for r in self.results) / len(self.results), 4) if self.results else 0.0

    @property
    def passed(self) -> bool:
        return bool(self.results) and self.score >= self.threshold

    def evidence(self, today: date, valid_days: int) -> dict[str, Any]:
        """The quality_gate record (extproc/config/schema.Evidence), without its basis."""
        return {
            "deployment_ref": self.deployment_ref, "kind": "quality_gate",
            "result": "pass" if self.passed else "fail", "recorded_at": today.isoformat(),
            "expires_at": (today + timedelta(days=valid_days)).isoformat(), "source": SOURCE,
            "adapter": self.adapter, "corpus_version": self.corpus_version, "request_class": self.request_class,
            "score": self.score, "threshold": self.threshold,
            "cases": [{"id": r.id, "result": r.result, **({"detail": r.detail} if r.detail else {})}
                      for r in self.results],
        }


def evaluate_in(s: Session, corpus: QualityCorpus, route: Route, threshold: float) -> Evaluation:
    """Every task of `corpus` through the session's gateway under `route`'s policy, graded."""
    gw = s.gateway("evaluate", route.route_contract)
    out = Evaluation(s.sandbox.ref, s.dep.fingerprint.adapter, route.request_class, corpus.version, corpus.digest,
                     threshold)
    for task in corpus.tasks:
        body = {**json.loads(json.dumps(task.request)), "model": gw.route}
        answer = send(gw.url, gw.key, body, {})
        g = grade(task, answer)
        out.results.append(CaseResult(task.id, "pass" if g.right else "fail", f"{task.kind}: {g.detail}" if g.detail
                                      else "", sandbox_fault=sandbox_failed(answer)))
    return out
