"""Tool packs shipped with the gateway: each client's own tools with their effects written down, for
gateway.yaml `tool_packs` (extproc/tool_catalog.py). One file per client, named as the client."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def shipped(name: str) -> Path | None:
    path = HERE / f"{name}.yaml"
    return path if path.is_file() else None


def shipped_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in HERE.glob("*.yaml")))
