"""docker-compose.yml agrees with the policy it ships with and with what `llmgw envoy render --compose`
produces: every address the rendered config names is a service, ext_proc and the loops are told the
pools the renderer drew, and each simulated engine or provider serves what its deployment declares (a
pool engine whose window differs from its fingerprint's is voided by the engine check, and its route
stops serving: seen in the first real `docker compose up`). The composed run itself is tests/compose/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.names import EXTPROC_CLUSTER
from llmgw.local.stack import provider_api
from llmgw.render.bootstrap import COMPOSE_EXTPROC_SOCKET, RenderOptions, render_yaml
from llmgw.render.common import UNIX
from tests.conftest import EARNED, EXAMPLE_POLICY, ROOT


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


def flag(compose: dict[str, Any], service: str, name: str) -> list[str]:
    """Every value of `--name` in a service's command (`--name value` and `--name=value`)."""
    cmd = compose["services"][service]["command"]
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name] + [a.split("=", 1)[1] for a in cmd
                                                                     if a.startswith(f"{name}=")]


@pytest.fixture(scope="module")
def rendered() -> RenderOptions:
    return RenderOptions.for_compose(load_snapshot(committed_policy()))


def test_every_address_the_rendered_config_names_is_a_service(compose: dict[str, Any], rendered: RenderOptions) -> None:
    hosts = {h for eps in (*rendered.pools.values(), *rendered.providers.values()) for h, _ in eps}
    assert hosts <= set(compose["services"]), hosts - set(compose["services"])
    assert set(compose["services"]["envoy"]["depends_on"]) >= hosts | {"extproc"}


def test_ext_proc_listens_on_the_socket_envoy_is_rendered_to_and_only_they_mount_it(
        compose: dict[str, Any], envoy_cfg: dict[str, Any], rendered: RenderOptions) -> None:
    (c,) = [c for c in envoy_cfg["static_resources"]["clusters"] if c["name"] == EXTPROC_CLUSTER]
    (endpoint,) = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {"pipe": {"path": COMPOSE_EXTPROC_SOCKET}}
    assert rendered.extproc == ((UNIX + COMPOSE_EXTPROC_SOCKET, 50051),)
    assert flag(compose, "extproc", "--listen") == [UNIX + COMPOSE_EXTPROC_SOCKET]
    services = compose["services"]
    folder = COMPOSE_EXTPROC_SOCKET.rsplit("/", 1)[0]
    mounting = {name for name, svc in services.items()
                if any(str(v).endswith(f":{folder}") for v in svc.get("volumes", []))}
    assert mounting == {"envoy", "extproc"}
    assert services["envoy"]["networks"] == ["apps", "backend"]
    assert {name for name, svc in services.items() if "apps" in svc.get("networks", [])} == {"envoy"}


def test_ext_proc_and_the_loops_are_told_the_pools_the_renderer_drew(compose: dict[str, Any],
                                                                       rendered: RenderOptions) -> None:
    pools = {f"{name}={','.join(f'{h}:{p}' for h, p in eps)}" for name, eps in rendered.pools.items()}
    assert set(flag(compose, "extproc", "--pool")) == pools
    engines = {f"{name}=http://{h}:{p}" for name, eps in rendered.pools.items() for h, p in eps}
    assert set(flag(compose, "loops", "--engine")) == engines


def test_each_simulator_serves_what_its_deployment_declares(compose: dict[str, Any], rendered: RenderOptions) -> None:
    snap = load_snapshot(committed_policy())
    for dep in snap.deployments.values():
        if dep.pool:
            hosts, api = list(rendered.pools[dep.pool]), "openai"
        elif dep.deployment in rendered.providers:
            hosts, api = list(rendered.providers[dep.deployment]), provider_api(dep)
        else:
            continue
        for service, port in hosts:
            cmd = compose["services"][service]["command"]
            assert flag(compose, service, "--port") == [str(port)], service
            assert flag(compose, service, "--served-model-name") == [dep.served_model], service
            assert flag(compose, service, "--max-model-len") == [str(dep.context_window)], service
            assert (flag(compose, service, "--api") or ["openai"]) == [api], service
            assert ("--runner" in cmd) == (dep.serves == "embeddings"), service


def test_published_port_is_the_listener_on_loopback(compose: dict[str, Any], envoy_cfg: dict[str, Any]) -> None:
    listener = envoy_cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"  # inside its container
    (published,) = compose["services"]["envoy"]["ports"]
    assert published == f"${{LLMGW_PUBLISH:-127.0.0.1}}:${{LLMGW_PORT:-8080}}:{listener['port_value']}"
    # ext_proc is told where the gateway is published, and refuses demo keys beyond loopback.
    assert compose["services"]["extproc"]["environment"]["LLMGW_PUBLIC_ADDRESS"] == "${LLMGW_PUBLISH:-127.0.0.1}"
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith(("127.0.0.1:", "${LLMGW_PUBLISH:-127.0.0.1}:")), (name, port)


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    """Each image, as a user's copy names it: the default of its variable (`${LLMGW_IMAGE:-...}`)."""
    for name, svc in compose["services"].items():
        image = re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", svc["image"])
        assert "$" not in image, (name, image)
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert tag and "latest" not in tag, f"{name}: {image} is not pinned"


def test_dockerfile_runs_the_extproc_module() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["python", "-m", "extproc"' in text
    assert Path(ROOT / "policy").is_dir()
