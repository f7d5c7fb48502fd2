"""Credential references (`env:NAME`, `file:PATH`), resolved at run time, never stored in config.

`env:NAME` also reads the file that `$NAME_FILE` names when `$NAME` is not set: container secrets
(docker-compose's `secrets:`, Kubernetes' mounted Secrets) arrive as files, and the convention keeps a
policy's references the same wherever it runs.
"""

from __future__ import annotations

import os
from pathlib import Path


class SecretUnavailable(Exception):
    """A reference that cannot be resolved; the message names the reference, never a value."""


def env_name(ref: str | None) -> str:
    """The variable an `env:NAME` reference names; "" for any other reference (or none)."""
    kind, _, name = (ref or "").partition(":")
    return name if kind == "env" else ""


def resolve(ref: str, base: Path | None = None) -> str:
    kind, _, target = ref.partition(":")
    if kind == "env":
        value = os.environ.get(target)
        if value:
            return value
        if named := os.environ.get(f"{target}_FILE"):
            return _read(ref, Path(named))
        raise SecretUnavailable(f"credential reference {ref} is not set")
    if kind == "file":
        path = Path(target)
        if base is not None and not path.is_absolute():
            path = base / path
        return _read(ref, path)
    raise SecretUnavailable(f"credential reference {ref!r} is neither env:NAME nor file:PATH")


def _read(ref: str, path: Path) -> str:
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SecretUnavailable(f"credential reference {ref} cannot be read ({path}): {e.strerror}") from None
    if not value:
        raise SecretUnavailable(f"credential reference {ref} is empty ({path})")
    return value
