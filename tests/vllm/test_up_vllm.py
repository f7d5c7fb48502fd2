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
from tests.e2e.operations.test_season_e2e import CHAT_ROUTES, Run, Season
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


def test_real_vllm_and_the_simulated_engines_take_turns_on_one_state_directory(tmp_path: Path) -> None:
    """The season's engine step with the real engine (issue 43): one policy and one state directory
    through `llmgw up` (simulated engines), `llmgw up --engine vllm` (a stand-in with another window,
    version and block size than the demo's fingerprint: served, its evidence earned against it, never
    voided for the difference up itself made) and `llmgw up` again, which must serve every chat route,
    while the policy directory receives nothing (what the runs earn stays in the state directory)."""
    season = Season(tmp_path)
    doc = yaml.safe_load((season.policy / "gateway.yaml").read_text())
    doc["pools"]["engine-pool"]["endpoints"] = doc["pools"]["engine-pool"]["endpoints"][:1]  # one engine: 2 cores
    (season.policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    without_pool(season.policy, "embed-pool")
    own = season.evidence_files()

    def chat_routes_serve(run: Run) -> None:
        client = run.client()
        for route in CHAT_ROUTES:
            c = client.chat.completions.create(model=route, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            assert c.choices[0].message.content is not None, route

    with season.up() as run:
        chat_routes_serve(run)
    with season.up("--engine", "vllm", within_s=600) as run:
        client = run.client()
        c = client.chat.completions.create(model="chat-default", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert c.usage is not None and c.usage.completion_tokens == 3
    assert not list((season.state / "evidence").rglob("*engine_mismatch*"))  # (nothing any engine could lift)
    with season.up() as run:
        chat_routes_serve(run)
    assert season.evidence_files() == own  # the checkout stays as its operator wrote it
