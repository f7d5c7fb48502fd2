"""`llmgw up` as a user runs it: one command, a streaming answer, up.json, and a clean stop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.local.procs import free_port
from tests.conftest import POLICY

pytestmark = pytest.mark.e2e


def children_of(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_up(proc: subprocess.Popen[str], state: Path, within_s: float = 60) -> dict[str, Any]:
    """`llmgw up`'s up.json once it is written; fails with the command's output if it exits first."""
    t0 = time.monotonic()
    while not (state / "up.json").exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() - t0 < within_s, f"not up within {within_s:.0f} s"
        time.sleep(0.1)
    info: dict[str, Any] = json.loads((state / "up.json").read_text())
    return info


def log_tails(logs: Path, n: int = 15) -> str:
    """The last lines of every child's log: what a failure here needs to be understood."""
    return "\n".join(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-n:])
                     for f in sorted(logs.glob("*.log")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_then_stops_every_child(tmp_path: Path, sig: signal.Signals) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    state = tmp_path / "state"
    port = free_port()  # a port named on the command line wins over --free-ports
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "up", "--config", str(policy), "--state-dir",
                             str(state), "--free-ports", "--port", str(port), "--time-scale", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        info = wait_up(proc, state)
        assert info["url"] == f"http://127.0.0.1:{port}"
        assert info["admin_url"].startswith("http://127.0.0.1:")
        key = info["tenants"]["acme"]["api_key"]
        client = openai.OpenAI(base_url=f"{info['url']}/v1", api_key=key, max_retries=0)
        try:
            stream = client.chat.completions.create(model="chat-default", max_tokens=5, stream=True,
                                                    messages=[{"role": "user", "content": "hi"}])
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except (openai.OpenAIError, AssertionError) as err:
            raise AssertionError(f"{err}\n{log_tails(Path(info['logs']))}") from err
        kids = children_of(proc.pid)
        assert len(kids) == 9  # valkey, two engines, an embedding engine, three simulated providers, ext_proc, envoy
        # The revision it serves is in the audited history, so it can be rolled back to.
        listed = subprocess.run([sys.executable, "-m", "llmgw", "revisions", "--config", str(policy),
                                 "--state-dir", str(state), "--json"], capture_output=True, text=True, timeout=60)
        (started,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (started["action"], started["revision"], started["accepted"]) == ("start", info["revision"], True)
        assert started["who"].endswith("(llmgw up)")
    finally:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "llmgw stopped." in out and "tenant acme" in out
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "orphaned children"
    assert not (state / "up.json").exists()


def test_up_refuses_invalid_config(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    (policy / "gateway.yaml").write_text("data_classes: []\ntenants: {}\n")
    r = subprocess.run([sys.executable, "-m", "llmgw", "up", "--config", str(policy), "--state-dir",
                        str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "invalid configuration" in r.stderr


def test_make_up_defaults_are_held_while_the_suite_runs(make_up_serving: list[tuple[str, int]]) -> None:
    """Every default port of `make up` (gateway, admin, store, engines, simulated providers, workers)
    is taken during the whole session, so a test that listens on one fails (tests/conftest.py)."""
    from llmgw.local.procs import port_free

    assert len(make_up_serving) >= 9, make_up_serving
    assert ("127.0.0.1", 8080) in make_up_serving and ("127.0.0.1", 6390) in make_up_serving
    assert not [hp for hp in make_up_serving if port_free(*hp)], "a default port is free during the suite"
