"""Deprecations as scheduled outages (issue 16, part 4): `retire_at` with its owner and a replacement
that must be qualified before the date. `llmgw check` fails inside the warning window when either is
missing or the replacement cannot take the traffic, and warns before it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from llmgw.ops.deprecations import findings
from tests.conftest import POLICY
from tests.helpers import llmgw

TODAY = date.today()
SOON = TODAY + timedelta(days=10)  # inside the 30-day window
LATER = TODAY + timedelta(days=200)


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml"))
    return dst


def retire(policy: Path, name: str, when: date, **fields: Any) -> None:
    def change(d: dict[str, Any]) -> None:
        d.update(retire_at=when.isoformat(), **fields)
        for k in [k for k, v in d.items() if v is None]:
            del d[k]
    edit(policy / "deployments" / f"{name}.yaml", change)


CASES = [  # (retiring deployment, its owner and replacement, the finding)
    ("demo-anthropic", {"retire_owner": None, "retire_replacement": "chat-default"}, "no retire_owner"),
    ("demo-anthropic", {"retire_owner": "team", "retire_replacement": None}, "no retire_replacement"),
    ("demo-anthropic", {"retire_owner": "team", "retire_replacement": "no-such"}, "names no route or deployment"),
    # The only other candidate of the route is the retiring one itself.
    ("demo-anthropic", {"retire_owner": "team", "retire_replacement": "chat-anthropic"},
     "has no qualified candidate besides demo-anthropic"),
    # A deployment that is not beside it on its routes replaces nothing.
    ("demo-anthropic", {"retire_owner": "team", "retire_replacement": "demo-gemini"},
     "demo-gemini is not a candidate of route chat-anthropic"),
]


@pytest.mark.parametrize(("name", "fields", "finding"), CASES, ids=[c[2] for c in CASES])
def test_inside_the_window_a_missing_or_unqualified_replacement_fails_the_check(
        policy: Path, name: str, fields: dict[str, Any], finding: str) -> None:
    retire(policy, name, SOON, **fields)
    found = findings(load_snapshot(policy), TODAY)
    assert any(f.error and finding in f.text for f in found), found
    out = llmgw("check", str(policy))
    assert out.returncode == 1 and f"error: deployment {name} retires {SOON}" in out.stderr and finding in out.stderr


def test_before_the_window_the_same_findings_are_warnings(policy: Path) -> None:
    retire(policy, "demo-anthropic", LATER, retire_owner=None, retire_replacement=None)
    found = findings(load_snapshot(policy), TODAY)
    assert found and not any(f.error for f in found)
    out = llmgw("check", str(policy))
    assert out.returncode == 0 and "warning: deployment demo-anthropic retires" in out.stderr


def test_a_qualified_replacement_passes_route_or_deployment(policy: Path) -> None:
    retire(policy, "demo-anthropic", SOON, retire_owner="team", retire_replacement="chat-default")
    assert findings(load_snapshot(policy), TODAY) == []
    # A deployment beside it on every route it serves: the pool on chat-fallback, once chat-anthropic
    # also lists the pool.
    retire(policy, "demo-anthropic", SOON, retire_owner="team", retire_replacement="pool-llama-8b")
    pool = next(c for c in yaml.safe_load((policy / "routes/chat-fallback.yaml").read_text())["candidates"]
                if c["deployment_ref"].startswith("pool-llama-8b@"))
    edit(policy / "routes/chat-anthropic.yaml", lambda d: d["candidates"].append(pool))
    assert findings(load_snapshot(policy), TODAY) == []
    assert llmgw("check", str(policy)).returncode == 0


def test_a_replacement_without_evidence_or_retiring_as_early_is_not_qualified(policy: Path) -> None:
    retire(policy, "demo-anthropic", SOON, retire_owner="team", retire_replacement="chat-default")
    (policy / "evidence/pool-llama-8b-conformance-chat-default.yaml").unlink()
    assert any("chat-default has no qualified candidate" in f.text for f in findings(load_snapshot(policy), TODAY))
    shutil.copy(POLICY / "evidence/pool-llama-8b-conformance-chat-default.yaml", policy / "evidence")
    retire(policy, "pool-llama-8b", SOON, retire_owner="team", retire_replacement="chat-anthropic")
    text = " ".join(f.text for f in findings(load_snapshot(policy), TODAY))
    assert "chat-default has no qualified candidate besides demo-anthropic" in text  # the pool leaves the same day


def test_owner_or_replacement_without_a_date_is_a_config_error(policy: Path) -> None:
    edit(policy / "deployments/pool-llama-8b.yaml", lambda d: d.update(retire_owner="team"))
    with pytest.raises(ConfigError, match="set retire_at"):
        load_snapshot(policy)
