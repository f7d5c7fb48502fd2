"""The corpora evidence is earned on, shipped with the gateway and versioned: the conformance corpus per
thing a deployment serves, and the task-quality corpora a request class may name.

They live in the data plane because the data plane enforces what they mean: a record is bound to the
digest of the corpus it ran (extproc/config/evidence.py), so editing a case voids every record earned
on the old text, whatever its `version` says. The runners and scorers are the control plane's
(llmgw/conformance/, llmgw/quality/); the simulator reads a quality corpus as its oracle by path.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
CONFORMANCE = {"chat": HERE / "conformance-chat.yaml", "embeddings": HERE / "conformance-embeddings.yaml"}
QUALITY_PREFIX = "quality-"  # quality-<name>.yaml: a request class names `<name>`


def quality_corpus(name: str, policy_dir: Path) -> Path:
    """The quality corpus a request class names: a shipped one by name (`general`), or a `.yaml` path
    relative to the policy directory (a policy author's own tasks)."""
    return (policy_dir / name) if name.endswith((".yaml", ".yml")) else HERE / f"{QUALITY_PREFIX}{name}.yaml"


def shipped_quality() -> list[str]:
    return sorted(p.stem.removeprefix(QUALITY_PREFIX) for p in HERE.glob(f"{QUALITY_PREFIX}*.yaml"))


def digest_of(doc: Any) -> str:
    """The digest of a corpus's content (its parsed YAML, canonical JSON): comments and layout do not
    change it, a changed case does."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    return digest_of(yaml.safe_load(path.read_text(encoding="utf-8")))


def file_digest(path: Path) -> str | None:
    """The digest of the corpus at `path` now (None when it cannot be read: no record matches it)."""
    try:
        st = path.stat()
        return _file_digest(path, st.st_mtime_ns, st.st_size)
    except (OSError, yaml.YAMLError):
        return None
