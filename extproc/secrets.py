"""Credential references (`env:NAME`, `file:PATH`), resolved at run time, never stored in config."""

from __future__ import annotations

import os
from pathlib import Path


class SecretUnavailable(Exception):
    """A reference that cannot be resolved; the message names the reference, never a value."""


def resolve(ref: str, base: Path | None = None) -> str:
    kind, _, target = ref.partition(":")
    if kind == "env":
        value = os.environ.get(target)
        if not value:
            raise SecretUnavailable(f"credential reference {ref} is not set")
        return value
    if kind == "file":
        path = Path(target)
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            value = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise SecretUnavailable(f"credential reference {ref} cannot be read: {e.strerror}") from None
        if not value:
            raise SecretUnavailable(f"credential reference {ref} is empty")
        return value
    raise SecretUnavailable(f"credential reference {ref!r} is neither env:NAME nor file:PATH")
