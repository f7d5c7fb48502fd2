"""Configuration: strict parsing, cross-checks that name file and field, and a stable revision."""

from __future__ import annotations

import shutil
from datetime import date
from pathlib import Path

import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from tests.conftest import POLICY
from tests.helpers import llmgw


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    return dst


def edit(path: Path, fn) -> None:  # type: ignore[no-untyped-def]
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc))


def issues_of(directory: Path) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        load_snapshot(directory)
    return [str(i) for i in exc.value.issues]


def test_example_policy_loads() -> None:
    snap = load_snapshot(POLICY)
    assert set(snap.routes) == {"chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback"}
    assert set(snap.gateway.tenants) == {"acme", "globex"}
    assert len(snap.revision) == 16
    with pytest.raises(TypeError):
        snap.routes["x"] = snap.routes["chat-default"]  # type: ignore[index]


def test_snapshot_models_are_frozen() -> None:
    snap = load_snapshot(POLICY)
    with pytest.raises(ValueError):
        snap.routes["chat-default"].deadline_ms = 1  # type: ignore[misc]


def test_revision_is_stable_and_tracks_content(policy: Path) -> None:
    a = load_snapshot(policy).revision
    assert load_snapshot(policy).revision == a
    (policy / "gateway.yaml").write_text((policy / "gateway.yaml").read_text() + "\n# a comment only\n")
    assert load_snapshot(policy).revision == a  # comments do not change what is served
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=1234))
    assert load_snapshot(policy).revision != a


@pytest.mark.parametrize(("file", "mutate", "expected"), [
    ("gateway.yaml", lambda d: d.update(surprise=1), "gateway.yaml: surprise: Extra inputs are not permitted"),
    ("gateway.yaml", lambda d: d["tenants"]["acme"].update(default_data_class="secret"),
     "gateway.yaml: tenants.acme"),
    ("gateway.yaml", lambda d: d["tenants"]["acme"].update(api_keys=[{"id": "k1", "sha256": "short"}]),
     "gateway.yaml: tenants.acme.api_keys.0.sha256"),
    ("routes/chat-default.yaml", lambda d: d.update(deadline_ms=-5), "routes/chat-default.yaml: deadline_ms"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(deployment_ref="pool-llama-8b"),
     "routes/chat-default.yaml: candidates.0.deployment_ref"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(
        deployment_ref="pool-llama-8b@sha256:" + "0" * 64), "fingerprint does not match"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(data_classes=["restricted"]),
     "does not serve 'restricted'"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(regions=["us"]), "not in region 'us'"),
    ("routes/chat-default.yaml", lambda d: d.update(credential_ref="sk-plaintext-secret"),
     "routes/chat-default.yaml: credential_ref"),
    ("deployments/pool-llama-8b.yaml", lambda d: d.update(pool="nowhere"), "no pool named 'nowhere'"),
    ("deployments/pool-llama-8b.yaml", lambda d: d["fingerprint"].pop("engine"),
     "deployments/pool-llama-8b.yaml: fingerprint.engine"),
])
def test_errors_name_file_and_field(policy: Path, file: str, mutate, expected: str) -> None:  # type: ignore[no-untyped-def]
    edit(policy / file, mutate)
    found = issues_of(policy)
    assert any(expected in i for i in found), found


def test_fingerprint_change_invalidates_route_ref(policy: Path) -> None:
    edit(policy / "deployments/pool-llama-8b.yaml", lambda d: d["fingerprint"].update(precision="fp8"))
    issues = issues_of(policy)  # every route that names the pool: chat-default and chat-fallback
    assert {i.split(":")[0] for i in issues} == {"routes/chat-default.yaml", "routes/chat-fallback.yaml"}
    assert all("candidates.0.deployment_ref" in msg and "it is now pool-llama-8b@sha256:" in msg for msg in issues)


def test_broken_yaml_is_reported(policy: Path) -> None:
    (policy / "routes/broken.yaml").write_text("route_contract: [unclosed\n")
    assert any(i.startswith("routes/broken.yaml: cannot read YAML") for i in issues_of(policy))


def test_duplicate_route_names(policy: Path) -> None:
    shutil.copy(policy / "routes/chat-default.yaml", policy / "routes/copy.yaml")
    assert any("also defined in routes/chat-default.yaml" in i for i in issues_of(policy))


def test_retirement_warnings(policy: Path) -> None:
    snap = load_snapshot(policy, today=date(2027, 12, 15))
    assert any("retires on 2027-12-31" in w for w in snap.warnings)
    snap = load_snapshot(policy, today=date(2028, 1, 2))
    assert any("retired since 2027-12-31" in w for w in snap.warnings)


def test_check_cli_prints_revision() -> None:
    r = llmgw("check", str(POLICY))
    assert r.returncode == 0, r.stderr
    assert f"revision {load_snapshot(POLICY).revision}" in r.stdout


def test_check_cli_reports_qualification(policy: Path) -> None:
    assert "route chat-default: candidate pool-llama-8b: qualified" in llmgw("check", str(policy)).stdout
    (policy / "evidence/pool-llama-8b-quality-gate.yaml").unlink()
    r = llmgw("check", str(policy))
    assert r.returncode == 0  # valid configuration; the candidate just cannot serve
    assert "candidate pool-llama-8b: NOT ELIGIBLE: no passing quality_gate evidence" in r.stdout


def test_check_cli_lists_every_error(policy: Path) -> None:
    edit(policy / "gateway.yaml", lambda d: d.update(surprise=1))
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=0))
    r = llmgw("check", str(policy))
    assert r.returncode == 1
    assert "gateway.yaml: surprise" in r.stderr and "routes/chat-default.yaml: deadline_ms" in r.stderr
