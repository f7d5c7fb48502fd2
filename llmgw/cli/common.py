"""What several `llmgw` commands share."""

from __future__ import annotations

import sys
from pathlib import Path

from extproc.config import ConfigError, Snapshot, load_snapshot


def engines_by_pool(snap: Snapshot, specs: list[str]) -> dict[str, list[str]]:
    """Each pool's engine URLs: `--engine POOL=URL` as given (repeatable), else gateway.yaml's endpoints."""
    given: dict[str, list[str]] = {}
    for spec in specs:
        pool, _, url = spec.partition("=")
        given.setdefault(pool, []).append(url)
    return given or {name: [f"http://{e}" for e in pool.endpoints] for name, pool in snap.gateway.pools.items()}


def snapshot_or_report(directory: str | Path) -> Snapshot | None:
    """The policy directory's snapshot, or None after printing every problem with file and field."""
    try:
        return load_snapshot(directory)
    except ConfigError as e:
        print(f"error: invalid configuration\n{e}", file=sys.stderr)
        return None
