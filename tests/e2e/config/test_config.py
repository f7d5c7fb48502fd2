"""Configuration: strict parsing, cross-checks that name file and field, and a stable revision."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
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
    """Each issue as printed, its path relative to the policy directory."""
    with pytest.raises(ConfigError) as exc:
        load_snapshot(directory)
    return [str(replace(i, directory="")) for i in exc.value.issues]


def test_example_policy_loads() -> None:
    snap = load_snapshot(POLICY)
    assert set(snap.routes) == {"chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback",
                                "embed-default"}
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
    ("gateway.yaml", lambda d: d.update(surprise=1), "surprise: Extra inputs are not permitted"),
    ("gateway.yaml", lambda d: d["tenants"]["acme"].update(default_data_class="secret"),
     "tenants.acme"),
    ("gateway.yaml", lambda d: d["tenants"]["acme"].update(api_keys=[{"id": "k1", "sha256": "short"}]),
     "tenants.acme.api_keys.0.sha256"),
    ("routes/chat-default.yaml", lambda d: d.update(deadline_ms=-5), "deadline_ms"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(deployment_ref="pool-llama-8b"),
     "candidates.0.deployment_ref"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(
        deployment_ref="pool-llama-8b@sha256:" + "0" * 64), "fingerprint does not match"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(data_classes=["restricted"]),
     "does not serve 'restricted'"),
    ("routes/chat-default.yaml", lambda d: d["candidates"][0].update(regions=["us"]), "not in region 'us'"),
    ("routes/chat-default.yaml", lambda d: d.update(credential_ref="sk-plaintext-secret"),
     "credential_ref"),
    ("deployments/pool-llama-8b.yaml", lambda d: d.update(pool="nowhere"), "no pool named 'nowhere'"),
    ("deployments/pool-llama-8b.yaml", lambda d: d["fingerprint"].pop("engine"),
     "fingerprint.engine"),
])
def test_errors_name_file_and_field(policy: Path, file: str, mutate, expected: str) -> None:  # type: ignore[no-untyped-def]
    edit(policy / file, mutate)
    found = issues_of(policy)
    placed = re.compile(rf"{re.escape(file)}:[1-9][0-9]*:[1-9][0-9]*: ")  # path:line:col: for editors
    assert any(placed.match(i) and expected in i for i in found), found


def test_fingerprint_change_invalidates_route_ref(policy: Path) -> None:
    edit(policy / "deployments/pool-llama-8b.yaml", lambda d: d["fingerprint"].update(precision="fp8"))
    issues = issues_of(policy)  # every route that names the pool: chat-default and chat-fallback
    assert {i.split(":")[0] for i in issues} == {"routes/chat-default.yaml", "routes/chat-fallback.yaml"}
    assert all("candidates.0.deployment_ref" in msg and "it is now pool-llama-8b@sha256:" in msg for msg in issues)


def test_broken_yaml_is_reported(policy: Path) -> None:
    (policy / "routes/broken.yaml").write_text("route_contract: [unclosed\n")
    assert issues_of(policy) == ["routes/broken.yaml:2:1: cannot read YAML: while parsing a flow sequence: "
                                 "expected ',' or ']', but got '<stream end>'"]  # and nothing more of that file


def test_duplicate_route_names(policy: Path) -> None:
    shutil.copy(policy / "routes/chat-default.yaml", policy / "routes/copy.yaml")
    assert any("also defined in routes/chat-default.yaml" in i for i in issues_of(policy))


def test_retirement_warnings(policy: Path) -> None:
    edit(policy / "deployments/demo-anthropic.yaml", lambda d: d.update(
        retire_at="2027-12-31", retire_owner="platform-inference", retire_replacement="chat-default"))
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
    (policy / "evidence/pool-llama-8b-quality-gate-chat-default.yaml").unlink()
    r = llmgw("check", str(policy))
    assert r.returncode == 0  # valid configuration; the candidate just cannot serve
    assert "candidate pool-llama-8b: NOT ELIGIBLE: no passing quality_gate evidence" in r.stdout


def test_check_cli_lists_every_error(policy: Path) -> None:
    edit(policy / "gateway.yaml", lambda d: d.update(surprise=1))
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=0))
    r = llmgw("check", str(policy))
    assert r.returncode == 1
    assert re.search(rf"^{re.escape(str(policy))}/gateway.yaml:\d+:1: error: surprise: ", r.stderr, re.M), r.stderr
    assert re.search(rf"^{re.escape(str(policy))}/routes/chat-default.yaml:\d+:1: error: deadline_ms: ",
                     r.stderr, re.M), r.stderr


def line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def test_positions_point_at_the_field_the_issue_names(policy: Path, tmp_path: Path) -> None:
    """The line and column are the field's own (a schema error and a cross-check alike), and the path is
    the policy directory as the user named it: relative to where `llmgw check` runs."""
    route = policy / "routes/chat-default.yaml"
    text = route.read_text()
    route.write_text(text.replace("deadline_ms: 30000", "deadline_ms: -5"))
    r = llmgw("check", "policy", cwd=tmp_path)
    assert r.returncode == 1
    at = line_of(text, "deadline_ms:")
    assert f"policy/routes/chat-default.yaml:{at}:1: error: deadline_ms: Input should be greater than 0" \
        in r.stderr, r.stderr
    route.write_text(text.replace("[public, internal, confidential]", "[public, martian]")
                     .replace("@sha256:1", "@sha256:0"))
    found = issues_of(policy)
    for field in ("candidates.0.data_classes", "candidates.0.deployment_ref"):  # cross-checks, each on its line
        at = line_of(text, field.rsplit(".", 1)[1])
        assert any(i.startswith(f"routes/chat-default.yaml:{at}:5: {field}: ") for i in found), (field, found)


def test_a_rego_syntax_error_prints_path_line_col(policy: Path, tmp_path: Path) -> None:
    (policy / "authz.rego").write_text("package llmgw.authz\nimport rego.v1\n\nallow if {\n\tinput.a == == 1\n}\n")
    r = llmgw("check", "policy", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("policy/authz.rego:5:13: error: policy does not compile: "), r.stderr


def test_what_a_deployment_serves_must_be_what_its_routes_and_pool_serve(policy: Path) -> None:
    """A chat route cannot name an embeddings deployment; a pool's engines run one runner; embeddings
    come from a pool only."""
    edit(policy / "routes/chat-default.yaml", lambda d: d["candidates"].append(
        yaml.safe_load((policy / "routes/embed-default.yaml").read_text())["candidates"][0]))
    edit(policy / "deployments/pool-embed.yaml", lambda d: d.update(pool="engine-pool"))
    found = issues_of(policy)
    assert any("routes/chat-default.yaml" in i and "serves embeddings; this route serves chat" in i
               for i in found), found
    assert any("pool 'engine-pool' serves chat and embeddings" in i for i in found), found
    edit(policy / "deployments/pool-embed.yaml", lambda d: (d.pop("pool"), d.update(endpoints=["127.0.0.1:9"])))
    assert any("embeddings are served by an engine pool" in i for i in issues_of(policy))
