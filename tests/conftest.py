"""Fixtures that start the real processes (Envoy, ext_proc, Valkey, simulated engines) on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.config import load_snapshot
from llmgw.stack import DEMO_KEYS, Stack, StackOptions

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "policy"
# Simulated seconds run 20x faster than real ones: an 8B decode step of ~9 ms takes ~0.5 ms.
TIME_SCALE = 0.05


def start_stack(tmp: Path, config: Path = POLICY, **kw: object) -> Stack:
    snap = load_snapshot(config)
    opts = StackOptions.on_free_ports(config, tmp, snap, time_scale=kw.pop("time_scale", TIME_SCALE), **kw)
    return Stack(opts).start()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for tests that break a process."""
    s = start_stack(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def acme_key() -> str:
    return DEMO_KEYS["acme"]


@pytest.fixture(scope="session")
def globex_key() -> str:
    return DEMO_KEYS["globex"]
