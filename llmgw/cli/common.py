"""What several `llmgw` commands share."""

from __future__ import annotations

import sys
from pathlib import Path

from extproc.config import ConfigError, Snapshot, load_snapshot


def snapshot_or_report(directory: str | Path) -> Snapshot | None:
    """The policy directory's snapshot, or None after printing every problem with file and field."""
    try:
        return load_snapshot(directory)
    except ConfigError as e:
        print(f"error: invalid configuration\n{e}", file=sys.stderr)
        return None
