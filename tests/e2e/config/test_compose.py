"""docker-compose.yml agrees with what `llmgw envoy render --compose` produces (no Docker engine here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.names import EXTPROC_CLUSTER
from llmgw.render.bootstrap import RenderOptions, render_yaml
from tests.conftest import EARNED, EXAMPLE_POLICY, POLICY, ROOT


def committed_policy() -> Path:
    import shutil
    import tempfile

    dst = Path(tempfile.mkdtemp(prefix="llmgw-committed-")) / "policy"
    shutil.copytree(EXAMPLE_POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    return dst


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def envoy_cfg() -> dict[str, Any]:
    return yaml.load((ROOT / "envoy/envoy.compose.yaml").read_text(), Loader=yaml.CSafeLoader)  # megabytes


def test_committed_envoy_config_is_freshly_rendered() -> None:
    # From the policy as committed: no keys.yaml, no evidence (`llmgw up` writes them).
    snap = load_snapshot(committed_policy())
    assert (ROOT / "envoy/envoy.compose.yaml").read_text() == render_yaml(snap, RenderOptions.for_compose(snap)), \
        "run: llmgw envoy render --compose -o envoy/envoy.compose.yaml"
    assert (ROOT / "envoy/envoy.local.yaml").read_text() == render_yaml(snap, RenderOptions.from_snapshot(snap)), \
        "run: llmgw envoy render -o envoy/envoy.local.yaml"


def test_services_present(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert {"envoy", "extproc", "valkey", "engine-pool-1", "engine-pool-2", "vllm", "otel-collector"} <= set(s)
    assert s["vllm"]["profiles"] == ["gpu"]
    assert "build" in s["extproc"]


def test_volumes_exist_and_mount_the_rendered_config(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name}: {src} missing"
            else:
                assert src in compose["volumes"], f"{name}: named volume {src} not declared"
    assert "./envoy/envoy.compose.yaml:/etc/envoy/envoy.yaml:ro" in compose["services"]["envoy"]["volumes"]
    assert "/etc/envoy/envoy.yaml" in compose["services"]["envoy"]["command"]


def _cluster_hosts(envoy_cfg: dict[str, Any], name: str) -> list[tuple[str, int]]:
    (c,) = [c for c in envoy_cfg["static_resources"]["clusters"] if c["name"] == name]
    assert c["type"] == "STRICT_DNS"
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]


def test_cluster_addresses_are_compose_services(compose: dict[str, Any], envoy_cfg: dict[str, Any]) -> None:
    services = compose["services"]
    (host, port), = _cluster_hosts(envoy_cfg, EXTPROC_CLUSTER)
    assert host == "extproc" and f"0.0.0.0:{port}" in services["extproc"]["command"]
    snap = load_snapshot(POLICY)
    for dep in (d for d in snap.deployments.values() if d.pool):  # every pool's engines, each as its runner
        for host, port in _cluster_hosts(envoy_cfg, f"pool_{dep.pool}"):
            cmd = services[host]["command"]
            assert cmd[cmd.index("--port") + 1] == str(port)
            assert cmd[cmd.index("--served-model-name") + 1] == dep.served_model
            assert ("--runner" in cmd and cmd[cmd.index("--runner") + 1] == "pooling") == (dep.serves == "embeddings")
            assert host in services["envoy"]["depends_on"]


def test_published_port_is_the_listener_on_loopback(compose: dict[str, Any], envoy_cfg: dict[str, Any]) -> None:
    listener = envoy_cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"  # inside its container
    (published,) = compose["services"]["envoy"]["ports"]
    assert published == f"${{LLMGW_PUBLISH:-127.0.0.1}}:{listener['port_value']}:{listener['port_value']}"
    # ext_proc is told where the gateway is published, and refuses demo keys beyond loopback.
    assert compose["services"]["extproc"]["environment"]["LLMGW_PUBLIC_ADDRESS"] == "${LLMGW_PUBLISH:-127.0.0.1}"
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith(("127.0.0.1:", "${LLMGW_PUBLISH:-127.0.0.1}:")), (name, port)


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert tag and "latest" not in tag, f"{name}: {image} is not pinned"


def test_dockerfile_runs_the_extproc_module() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["python", "-m", "extproc"' in text
    assert Path(ROOT / "policy").is_dir()
