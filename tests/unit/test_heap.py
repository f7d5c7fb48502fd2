"""The worker's heap is frozen once built and again after each accepted reload (extproc/heap.py), so a
full garbage collection never walks the configuration in the middle of a decision."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc import heap
from extproc.config import load_snapshot
from extproc.config.reload import Live, Reloader
from tests.conftest import POLICY


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test process collects as usual


def frozen(obj: object) -> bool:
    """Whether the collector no longer walks `obj` (a frozen object is in no generation)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_what_is_alive_at_settle_is_frozen_and_what_comes_after_is_not() -> None:
    built = {"snapshot": [1, 2, 3]}
    heap.settle()
    assert frozen(built) and gc.get_freeze_count() > 0
    later = {"request": []}
    assert not frozen(later)


def test_an_accepted_reload_settles_the_heap_and_a_refused_one_does_not(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    snap = load_snapshot(policy)
    r = Reloader(policy, lambda s: Live(s, {}), Live(snap, {}))
    settled: list[str] = []
    monkeypatch.setattr(heap, "settle", lambda: settled.append(r.live.snapshot.revision))
    (policy / "gateway.yaml").write_text("data_classes: []\n")  # invalid: refused, the old one serves
    assert not r.reload("test") and settled == []
    shutil.copy(POLICY / "gateway.yaml", policy / "gateway.yaml")
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["budgets"] = []
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    assert r.reload("test") and settled == [r.live.snapshot.revision] != [snap.revision]
