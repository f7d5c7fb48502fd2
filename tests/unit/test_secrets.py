"""Credential references resolve at run time; failures name the reference, never a value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.secrets import SecretUnavailable, env_name, resolve
from tests.conftest import POLICY


def test_env_and_file_references(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_TEST_SECRET", "s3cret-env")
    assert resolve("env:LLMGW_TEST_SECRET") == "s3cret-env"
    (tmp_path / "k").write_text("s3cret-file\n")
    assert resolve("file:k", tmp_path) == "s3cret-file"
    assert resolve(f"file:{tmp_path / 'k'}") == "s3cret-file"


def test_an_env_reference_reads_the_file_its_FILE_variable_names(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Container secrets arrive as files: `env:NAME` reads $NAME, else the file $NAME_FILE names."""
    (tmp_path / "salt").write_text("from-a-file\n")
    monkeypatch.setenv("LLMGW_TEST_SECRET_FILE", str(tmp_path / "salt"))
    assert resolve("env:LLMGW_TEST_SECRET") == "from-a-file"
    monkeypatch.setenv("LLMGW_TEST_SECRET", "from-the-env")
    assert resolve("env:LLMGW_TEST_SECRET") == "from-the-env"  # the variable itself wins
    monkeypatch.delenv("LLMGW_TEST_SECRET")
    for content, said in (("", "is empty"), (None, "cannot be read")):
        if content is None:
            (tmp_path / "salt").unlink()
        else:
            (tmp_path / "salt").write_text(content)
        with pytest.raises(SecretUnavailable, match=said) as e:
            resolve("env:LLMGW_TEST_SECRET")
        assert "from-a-file" not in str(e.value)


def test_env_name_is_the_variable_an_env_reference_names() -> None:
    assert [env_name(r) for r in ("env:LLMGW_X", "file:/run/x", "vault:x", "", None)] == ["LLMGW_X", "", "", "", ""]


@pytest.mark.parametrize("ref", ["env:LLMGW_NOT_SET_ANYWHERE", "file:/nonexistent/key", "vault:x"])
def test_unresolvable_references(ref: str) -> None:
    with pytest.raises(SecretUnavailable) as e:
        resolve(ref)
    assert ref.split(":")[0] in str(e.value)


def test_extproc_refuses_to_start_without_its_salt_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_CACHE_SALT_SECRET"}
    r = subprocess.run([sys.executable, "-m", "extproc", "--config", str(POLICY), "--listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert "env:LLMGW_CACHE_SALT_SECRET is not set" in r.stderr


def test_deployment_credentials_resolve_when_a_revision_loads_not_per_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from extproc.config import load_snapshot
    from extproc.server import live_for

    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    monkeypatch.setenv("LLMGW_CACHE_SALT_SECRET", "salt")
    monkeypatch.setenv("LLMGW_REPLAY_KEY", "replay")
    monkeypatch.setenv("LLMGW_SIM_ANTHROPIC_KEY", "anthropic-key-1")
    monkeypatch.delenv("LLMGW_SIM_GEMINI_KEY", raising=False)
    live = live_for(load_snapshot(policy))
    assert live.credentials["demo-anthropic"] == "anthropic-key-1"
    # One deployment's missing key makes that deployment unaddressable, not the revision unservable.
    assert "demo-gemini" not in live.credentials
    assert live.credential_errors["demo-gemini"] == "credential reference env:LLMGW_SIM_GEMINI_KEY is not set"
    monkeypatch.setenv("LLMGW_SIM_ANTHROPIC_KEY", "anthropic-key-2")
    assert live.credentials["demo-anthropic"] == "anthropic-key-1"  # served as loaded until the next reload
    assert live_for(load_snapshot(policy)).credentials["demo-anthropic"] == "anthropic-key-2"
