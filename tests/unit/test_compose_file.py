"""docker-compose.yml agrees with the policy it ships with and with the Envoy config rendered for it:
every address the rendered config names is a service, ext_proc and the loops are told the pools the
renderer drew, and each simulated engine or provider serves what its deployment declares (a pool
engine whose window differs from its fingerprint's is voided by the engine check, and its route stops
serving: seen in the first real `docker compose up`). The composed run itself is tests/compose/."""

from __future__ import annotations

from typing import Any

import yaml

from extproc.config import load_snapshot
from llmgw.local.stack import provider_api
from llmgw.render.bootstrap import COMPOSE_EXTPROC_SOCKET, RenderOptions
from llmgw.render.common import UNIX
from tests.conftest import EXAMPLE_POLICY, ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
SNAP = load_snapshot(EXAMPLE_POLICY)
RENDERED = RenderOptions.for_compose(SNAP)


def flag(service: str, name: str) -> list[str]:
    """Every value of `--name` in a service's command (`--name value` and `--name=value`)."""
    cmd = SERVICES[service]["command"]
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name] + [a.split("=", 1)[1] for a in cmd
                                                                     if a.startswith(f"{name}=")]


def test_every_address_the_rendered_config_names_is_a_service() -> None:
    hosts = {h for eps in (*RENDERED.pools.values(), *RENDERED.providers.values()) for h, _ in eps}
    assert hosts <= set(SERVICES), hosts - set(SERVICES)
    assert set(SERVICES["envoy"]["depends_on"]) >= hosts | {"extproc"}


def test_ext_proc_listens_on_the_socket_envoy_is_rendered_to_and_only_they_mount_it() -> None:
    assert RENDERED.extproc == ((UNIX + COMPOSE_EXTPROC_SOCKET, 50051),)
    assert flag("extproc", "--listen") == [UNIX + COMPOSE_EXTPROC_SOCKET]
    folder = COMPOSE_EXTPROC_SOCKET.rsplit("/", 1)[0]
    mounting = {name for name, s in SERVICES.items()
                if any(str(v).endswith(f":{folder}") for v in s.get("volumes", []))}
    assert mounting == {"envoy", "extproc"}
    assert SERVICES["envoy"]["networks"] == ["apps", "backend"]
    on_apps = {name for name, s in SERVICES.items() if "apps" in s.get("networks", [])}
    assert on_apps == {"envoy"}, on_apps


def test_ext_proc_and_the_loops_are_told_the_pools_the_renderer_drew() -> None:
    pools = {f"{name}={','.join(f'{h}:{p}' for h, p in eps)}" for name, eps in RENDERED.pools.items()}
    assert set(flag("extproc", "--pool")) == pools
    engines = {f"{name}=http://{h}:{p}" for name, eps in RENDERED.pools.items() for h, p in eps}
    assert set(flag("loops", "--engine")) == engines


def test_each_simulator_serves_what_its_deployment_declares() -> None:
    for dep in SNAP.deployments.values():
        if dep.pool:
            services = [h for h, _ in RENDERED.pools[dep.pool]]
            api = "openai"
        elif dep.deployment in RENDERED.providers:
            services, api = [dep.deployment], provider_api(dep)
        else:
            continue
        for service in services:
            assert flag(service, "--served-model-name") == [dep.served_model], service
            assert flag(service, "--max-model-len") == [str(dep.context_window)], service
            assert (flag(service, "--api") or ["openai"]) == [api], service
            assert ("--runner" in SERVICES[service]["command"]) == (dep.serves == "embeddings"), service
