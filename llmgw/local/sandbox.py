"""A sandboxed gateway's policy: a copy of a policy directory with a demo key for each tenant that has
none (the conformance runner, the benchmarks and the chaos table each run one)."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmgw.local.demo_keys import ensure_demo_keys


def sandbox_policy(src: Path, dst: Path) -> tuple[Path, dict[str, str]]:
    """`src` copied to `dst`, with demo keys written beside it; the tenants' keys."""
    shutil.copytree(src, dst)
    keys, _ = ensure_demo_keys(dst, dst.parent / f"{dst.name}-keys")
    return dst, keys
