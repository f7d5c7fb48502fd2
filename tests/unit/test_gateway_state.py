"""A gateway's state directory as `llmgw up` and `llmgw init` prepare it: its own secrets made once,
owner-only, kept across starts, never made where the environment gives them; `llmgw init` refuses a
policy with no API key before it makes anything."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from extproc.config import load_snapshot
from llmgw.ops.gateway_state import ensure_admin_token, ensure_own_secrets
from tests.conftest import EARNED, EXAMPLE_POLICY
from tests.helpers import llmgw


def policy_without_keys(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(EXAMPLE_POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    return dst


def test_own_secrets_are_made_once_owner_only_and_not_where_the_environment_has_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_CACHE_SALT_SECRET", raising=False)
    monkeypatch.delenv("LLMGW_REPLAY_KEY", raising=False)
    snap = load_snapshot(policy_without_keys(tmp_path))
    state = tmp_path / "state"
    made = ensure_own_secrets(snap, state)
    assert set(made) == {"LLMGW_CACHE_SALT_SECRET", "LLMGW_REPLAY_KEY"}
    first = {name: path.read_text() for name, path in made.items()}
    for path in (*made.values(), ensure_admin_token(state)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) >= 32, path
    again = ensure_own_secrets(snap, state)
    assert {name: path.read_text() for name, path in again.items()} == first  # a restart keeps them
    monkeypatch.setenv("LLMGW_REPLAY_KEY", "from-the-operator")
    assert set(ensure_own_secrets(snap, state)) == {"LLMGW_CACHE_SALT_SECRET"}


def test_init_refuses_a_policy_without_api_keys_before_making_anything(tmp_path: Path) -> None:
    state = tmp_path / "state"
    r = llmgw("init", "--config", str(policy_without_keys(tmp_path)), "--state-dir", str(state))
    assert r.returncode == 1
    assert "no API key" in r.stderr and "llmgw keys create --tenant" in r.stderr, r.stderr
    assert not (state / "cache-salt.key").exists() and not (state / "evidence").exists()
