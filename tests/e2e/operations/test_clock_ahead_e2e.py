"""No date bomb: a fresh clone's `llmgw up`, with the clock two years ahead (libfaketime), earns the
demo's evidence under that clock and serves every demo route (llmgw/conformance/demo_evidence.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from datetime import date, timedelta
from pathlib import Path

import openai
import pytest
import yaml

from tests.conftest import EARNED, EXAMPLE_POLICY
from tests.e2e.operations.test_up import log_tails, wait_up

pytestmark = pytest.mark.e2e

AHEAD_DAYS = 730


def test_up_two_years_ahead_earns_its_evidence_and_serves_every_route(tmp_path: Path) -> None:
    # libfaketime preloaded into `llmgw up` itself (the faketime wrapper would not pass on its SIGTERM);
    # its Python children inherit it; Envoy keeps the real clock (llmgw/local/stack.py says why).
    lib = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
    assert lib, "Debian's faketime is missing: make test installs it (make system-deps)"
    ahead = date.today() + timedelta(days=AHEAD_DAYS)  # from wherever this process's clock stands
    env = {**os.environ, "LD_PRELOAD": str(lib), "FAKETIME": f"@{ahead.isoformat()} 12:00:00"}
    policy = tmp_path / "policy"  # as a fresh clone has it: no keys, no evidence
    shutil.copytree(EXAMPLE_POLICY, policy, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "up", "--config", str(policy), "--state-dir", str(state),
                             "--free-ports", "--time-scale", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        info = wait_up(proc, state, within_s=180)
        earned = state / "evidence"  # the gateway's state, not the policy's (extproc/config/earned.py)
        for record in sorted(earned.glob("*.yaml")):
            doc = yaml.safe_load(record.read_text())
            assert (doc["result"], str(doc["recorded_at"])) == ("pass", ahead.isoformat()), record.name
        # Conformance for each of five candidates under each route policy they serve under (chat-fallback's
        # retry differs: two more), a quality gate likewise but for embeddings (its class declares none).
        assert len(list(earned.glob("*.yaml"))) == 13
        assert not list((policy / "evidence").rglob("*.yaml"))  # the policy directory stays as its authors left it
        client = openai.OpenAI(base_url=f"{info['url']}/v1", api_key=info["tenants"]["acme"]["api_key"],
                               max_retries=0)
        served = {}
        for route in ("chat-default", "chat-anthropic", "chat-gemini", "chat-bedrock", "chat-fallback"):
            try:
                answer = client.chat.completions.create(model=route, max_tokens=5,
                                                        messages=[{"role": "user", "content": "hi"}])
            except openai.OpenAIError as err:
                raise AssertionError(f"{route}: {err}\n{log_tails(Path(info['logs']))}") from err
            served[route] = answer.choices[0].message.content
        served["embed-default"] = str(client.embeddings.create(model="embed-default", input="hi").data[0].embedding)
        assert all(served.values()), served
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert ("llmgw: earning evidence for demo-anthropic (none yet), demo-bedrock (none yet), demo-gemini (none yet), "
            "pool-embed (none yet), pool-llama-8b (none yet)") in out
