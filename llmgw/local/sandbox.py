"""A sandboxed gateway's policy: a copy of a policy directory with a demo key for each tenant that has
none (the conformance runner, the benchmarks and the chaos table each run one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from llmgw.local.demo_keys import ensure_demo_keys


def sandbox_policy(src: Path, dst: Path) -> tuple[Path, dict[str, str]]:
    """`src` copied to `dst` without the operator's API keys, with a demo key for every tenant written
    beside it; the tenants' keys. (A tenant with keys of its own gets no demo key, and the sandbox
    holds none of the operator's: after a key rotation it had no key to send the corpus with.)"""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("keys.yaml"))
    gateway = yaml.safe_load((dst / "gateway.yaml").read_text())
    for tenant in (gateway.get("tenants") or {}).values():
        tenant.pop("api_keys", None)
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gateway, sort_keys=False))
    keys, _ = ensure_demo_keys(dst, dst.parent / f"{dst.name}-keys")
    return dst, keys
