"""The policy directory's keys file (keys.yaml): API keys by hash, tenant and state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.config.schema import KeysFile, ManagedKey

KEY_PREFIX = "sk-llmgw-"


def read_keys(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    doc = yaml.safe_load(path.read_text()) or {}
    return [ManagedKey.model_validate(k).model_dump(mode="json", exclude_defaults=True)
            for k in KeysFile.model_validate(doc).keys]


def write_keys(path: Path, keys: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("# Managed by `llmgw keys`: SHA-256 hashes of API keys, never the keys.\n"
                   + yaml.safe_dump({"keys": keys}, sort_keys=False))
    tmp.replace(path)  # atomic: the reloader never sees half a file
