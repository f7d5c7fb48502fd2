"""Where evidence lives: what an operator commits, and what a running gateway earns.

Two folders hold evidence records (`*.yaml`) and run-time voids (`voids/*.yaml`), and the loader reads
both:

- `<policy>/evidence/`: records an operator earned for real candidates (`llmgw conformance`,
  `llmgw evaluate`, `llmgw bench sweep --evidence`) and committed with the policy.
- the earned-state folder, `$LLMGW_EVIDENCE_DIR` when set: what a running gateway writes by itself -
  the demo evidence `llmgw up` earns for the candidates it simulates, the voids of its loops (engine
  check, re-evaluation) - kept in its state directory (`llmgw up` sets it to `<state-dir>/evidence`
  for itself and every process it starts), so a policy directory under version control changes only
  through its authors and `llmgw apply`.

Unset, everything is read from and written to `<policy>/evidence/` (a policy directory that is its own
state, as the test suite's copies are).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "LLMGW_EVIDENCE_DIR"
VOIDS = "voids"


def earned_dir(policy: Path, earned: Path | None = None) -> Path:
    """Where what is earned or voided at run time is kept for the policy at `policy`: `earned` when
    given (a stack names its own), else the environment's, else the policy's own folder."""
    configured = earned or os.environ.get(ENV)
    return Path(configured).resolve() if configured else policy.resolve() / "evidence"


def evidence_dirs(policy: Path, earned: Path | None = None) -> tuple[Path, ...]:
    """Every folder whose records count for the policy at `policy`: its own, then the earned state's."""
    own = policy.resolve() / "evidence"
    kept = earned_dir(policy, earned)
    return (own,) if kept == own else (own, kept)


def voids_dir(policy: Path) -> Path:
    """Where a run-time trigger's void is written."""
    return earned_dir(policy) / VOIDS
