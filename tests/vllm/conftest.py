"""The real-vLLM lane: the gateway in front of vLLM's CPU build serving a generated tiny model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.config import load_snapshot
from llmgw.local.procs import Child, free_port, http_ok, python_module, wait_until
from llmgw.local.stack import Stack, StackOptions
from tests.conftest import POLICY

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the name the pool serves; the weights are the tiny model
MAX_MODEL_LEN = 1024


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


def without_pool(policy: Path, pool: str) -> None:
    """The policy copy at `policy` without `pool`, its deployments and the routes that name them: a
    real engine is a minute's start and a core's work, so a lane test starts only the engines it uses."""
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    del doc["pools"][pool]
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    gone = set()
    for path in (policy / "deployments").glob("*.yaml"):
        if yaml.safe_load(path.read_text()).get("pool") == pool:
            gone.add(path.stem)
            path.unlink()
    for path in (policy / "routes").glob("*.yaml"):
        if any(c["deployment_ref"].split("@")[0] in gone for c in yaml.safe_load(path.read_text())["candidates"]):
            path.unlink()


def start_vllm_stack(tmp: Path, engines: int, embeddings: bool = False) -> Stack:
    """The gateway with `engines` real vLLM engines in the pool (each on a free port), and with
    `embeddings` one more as the pooling runner serving the embeddings route."""
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["pools"]["engine-pool"]["endpoints"] = [f"127.0.0.1:{8101 + i}" for i in range(engines)]
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    if not embeddings:
        without_pool(policy, "embed-pool")
    opts = StackOptions.on_free_ports(policy, tmp / "state", load_snapshot(policy), engine="vllm",
                                      engine_timeout=300.0)
    return Stack(opts).start(timeout=300)


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One real vLLM engine in the pool: on 2 cores one is fast to start, and with one engine every
    request meets the same prefix cache, which makes cache assertions exact; beside it one pooling
    runner for the embeddings route."""
    stack = start_vllm_stack(tmp_path_factory.mktemp("vllm"), engines=1, embeddings=True)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def vllm_url(vllm_stack: Stack) -> str:
    return vllm_stack.engine_urls("engine-pool")[0]


@pytest.fixture(scope="session")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    child = Child("enginesim", python_module("enginesim", "--port", str(port), "--served-model-name", MODEL,
                                             "--max-model-len", str(MAX_MODEL_LEN), "--time-scale", "0.05"),
                  Path(tmp_path_factory.mktemp("sim")) / "sim.log").start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
    yield url
    child.stop()
