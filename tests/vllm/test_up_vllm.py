"""`llmgw up --engine vllm` as a user runs it: real vLLM engines, a streaming answer through Envoy."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import yaml

from tests.conftest import POLICY
from tests.e2e.operations.test_up import wait_up
from tests.vllm.conftest import without_pool


def test_up_with_real_vllm_streams(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["pools"]["engine-pool"]["endpoints"] = doc["pools"]["engine-pool"]["endpoints"][:1]  # one engine: 2 cores
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    without_pool(policy, "embed-pool")  # (the embeddings engine has tests of its own)
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "up", "--engine", "vllm", "--config", str(policy),
                             "--state-dir", str(state), "--free-ports"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        info = wait_up(proc, state, within_s=300)
        client = openai.OpenAI(base_url=f"{info['url']}/v1", api_key=info["tenants"]["acme"]["api_key"],
                               max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(
            model="chat-default", max_tokens=5, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "hello"}]))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        assert (state / "tiny-model" / "llmgw-tiny-model.json").exists()
        engine_logs = [p.read_text(errors="replace") for p in (state / "logs").glob("engine-*.log")]
        assert engine_logs and all("(APIServer pid=" in text for text in engine_logs)  # real vLLM, not the sim
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
