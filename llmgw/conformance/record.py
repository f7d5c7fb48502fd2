"""A conformance run's evidence record, `evidence/<deployment>-conformance.yaml` in the policy directory:
what `llmgw conformance` and the demo's own evidence (llmgw/conformance/demo_evidence.py) write."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import yaml

from extproc.config import Snapshot
from extproc.config.evidence import basis_for
from llmgw.conformance.runner import Run

HEADER = ("# Written by `llmgw conformance` (llmgw/conformance/): the corpus run against this exact\n"
          "# fingerprint through a gateway. Re-run it, do not edit it: a change to the fingerprint, the\n"
          "# adapter or the corpus is a new record.\n")


def write_record(config: Path, snap: Snapshot, name: str, result: Run, today: date, valid_days: int) -> Path:
    path = config / "evidence" / f"{name}-conformance.yaml"
    record = result.evidence(today, valid_days)
    # What it was earned under: a later price, quota or data-class policy change voids it.
    record["basis"] = basis_for(snap.gateway, snap.deployments[name]).model_dump(mode="json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(HEADER + yaml.safe_dump(record, sort_keys=False))
    return path
