"""`llmgw up` keeps the gateway up: a child that dies is started again and the gateway serves within
seconds, with every answered request in the ledger exactly once; a crash loop stops it; a busy port
or a demo key on an open listener is a one-line refusal."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from extproc.store import leases_key, ledger_entry, ledger_key
from llmgw.local.procs import Child, free_port
from llmgw.local.supervisor import CrashLoop, Supervisor
from tests.conftest import POLICY
from tests.e2e.operations.test_up import children_of, log_tails, wait_up
from tests.helpers import request

# How long before a crash Valkey's acknowledged writes may be lost under `appendfsync everysec`: it
# postpones a write for up to 2 s while a background fsync runs.
STORE_WRITE_BOUND_S = 2.0
VICTIMS = {  # what a child's command line holds
    "valkey": "valkey-server",
    "engine": "enginesim",
    "extproc": "-m extproc",
    "envoy": "_bin/envoy",
}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def child_pid(parent: int, what: str) -> int | None:
    return next((p for p in sorted(children_of(parent)) if what in cmdline(p)), None)


def up_policy(tmp: Path) -> Path:
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["store"]["lease_grace_ms"] = 500
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route["deadline_ms"] = 3000  # short leases: what the gateway lost track of is charged soon
    (policy / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    return policy


def start_up(tmp: Path, policy: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    state = tmp / "state"
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "up", "--config", str(policy), "--state-dir", str(state),
                             "--free-ports", "--time-scale", "0.05", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, wait_up(proc, state)


ENOUGH_ANSWERS = 50


@pytest.mark.e2e
def test_each_child_killed_under_load_is_restarted_and_nothing_leaves_the_ledger(tmp_path: Path) -> None:
    proc, info = start_up(tmp_path, up_policy(tmp_path))
    url, key = f"{info['url']}/v1/chat/completions", info["tenants"]["acme"]["api_key"]
    body = {"model": "chat-default", "max_tokens": 2, "messages": [{"role": "user", "content": "keep going"}]}
    answered: list[str] = []  # request ids of 200s
    answered_at: dict[str, float] = {}  # and when each came (monotonic)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                r = request(url, "POST", body, {"authorization": f"Bearer {key}"}, timeout=5)
                if r.status == 200:
                    answered_at[r.headers["x-request-id"]] = time.monotonic()
                    answered.append(r.headers["x-request-id"])
            except OSError:
                time.sleep(0.05)  # Envoy itself is down for a moment

    clients = [threading.Thread(target=load) for _ in range(3)]
    for c in clients:
        c.start()
    try:
        recovered = {}
        killed_at = {}
        for name, what in VICTIMS.items():
            pid = child_pid(proc.pid, what)
            assert pid, f"no {name} child"
            os.kill(pid, signal.SIGKILL)
            t0 = killed_at[name] = time.monotonic()
            before = len(answered)
            while True:  # serving again: a new answer arrives, from a gateway whose child was replaced
                new = child_pid(proc.pid, what)
                if new and new != pid and len(answered) > before + 3:
                    break
                assert time.monotonic() - t0 < 15, f"not serving 15 s after {name} was killed\n" \
                    f"{log_tails(Path(info['logs']))}"
                time.sleep(0.05)
            recovered[name] = round(time.monotonic() - t0, 1)
        print("serving again after (s):", recovered)
        assert all(s < 10 for s in recovered.values()), recovered
        t0 = time.monotonic()  # enough answers to mean something, however slow the machine is today
        while len(answered) < ENOUGH_ANSWERS and time.monotonic() - t0 < 30:
            time.sleep(0.1)
    finally:
        stop.set()
        for c in clients:
            c.join(10)
    try:
        store = redis.Redis.from_url(info["store_url"], decode_responses=True)
        deadline = time.monotonic() + 20  # leases of 3.5 s; the sweeper runs every second
        while store.zcard(leases_key("acme")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.zcard(leases_key("acme")) == 0, "reservations never settled"
        ids = [ledger_entry(f).get("request_id") for _, f in store.xrange(ledger_key("acme"))]
        assert len(ids) == len(set(ids)), "a request was settled twice"
        # Valkey runs with `appendfsync everysec` (record 0023): a write it postponed while a background
        # fsync ran - up to 2 s of them - dies with it, though its caller was answered. Only answers
        # settled in that window before Valkey was killed may be missing; any other is a lost entry.
        lost_with_store = {rid for rid, at in answered_at.items()
                           if killed_at["valkey"] - STORE_WRITE_BOUND_S <= at <= killed_at["valkey"] + 1.0}
        missing = set(answered) - set(ids)
        print(f"{len(missing & lost_with_store)} answer(s) lost with the killed store's last writes")
        assert len(answered) >= ENOUGH_ANSWERS and not missing - lost_with_store, \
            f"{len(missing - lost_with_store)} of {len(answered)} answers not in the ledger"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    for name in ("valkey", "engine-", "extproc-", "envoy"):
        assert any(line.startswith(f"llmgw: {name}") and "started again" in line for line in out.splitlines()), out


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "llmgw", "up", "--config", str(up_policy(tmp_path)), "--state-dir",
                            str(tmp_path / "s"), "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"error: the gateway did not start: port {port} on 127.0.0.1 is in use; choose another with --port "
        "(or gateway.yaml envoy.listen)"], r.stderr


def test_demo_keys_never_listen_beyond_loopback(tmp_path: Path) -> None:
    policy = up_policy(tmp_path)
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["envoy"]["listen"] = f"0.0.0.0:{free_port()}"
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    up = subprocess.run([sys.executable, "-m", "llmgw", "up", "--config", str(policy), "--state-dir",
                         str(tmp_path / "s")], capture_output=True, text=True, timeout=60)
    assert up.returncode == 1 and "refusing to listen on 0.0.0.0 while demo keys are configured" in up.stderr
    assert "Traceback" not in up.stderr
    render = subprocess.run([sys.executable, "-m", "llmgw", "envoy", "render", "--config", str(policy)],
                            capture_output=True, text=True, timeout=60)
    assert render.returncode == 1 and "demo keys" in render.stderr
    extproc = subprocess.run([sys.executable, "-m", "extproc", "--config", str(policy), "--listen",
                              f"127.0.0.1:{free_port()}", "--public-address", "0.0.0.0"],
                             capture_output=True, text=True, timeout=60)
    assert extproc.returncode != 0 and "demo keys" in extproc.stderr
    # With the demo keys revoked, the same listener is allowed.
    keys = yaml.safe_load((policy / "keys.yaml").read_text())
    for k in keys["keys"]:
        k["revoked"] = True
    (policy / "keys.yaml").write_text(yaml.safe_dump(keys))
    render = subprocess.run([sys.executable, "-m", "llmgw", "envoy", "render", "--config", str(policy)],
                            capture_output=True, text=True, timeout=60)
    assert render.returncode == 0, render.stderr


class _FakeChild(Child):
    """A child whose process is a short sleep: it exits whenever the test lets it."""

    def __init__(self, tmp: Path, seconds: float):
        super().__init__("flaky", [sys.executable, "-c", f"import time; time.sleep({seconds})"], tmp / "flaky.log")


def test_the_supervisor_backs_off_and_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    child = _FakeChild(tmp_path, 0).start()
    now = [0.0]
    out = io.StringIO()
    sup = Supervisor(lambda: [child], out=out, max_restarts=3, window_s=60, clock=lambda: now[0])
    delays = []
    with pytest.raises(CrashLoop) as e:
        for _ in range(200):
            assert child.proc is not None
            child.proc.wait(5)
            sup.poll()  # noticed: a restart is scheduled
            line = out.getvalue().splitlines()[-1]
            delays.append(float(line.split("starting it again in ")[1].split("s")[0]))
            now[0] += delays[-1]
            sup.poll()  # due: started again
    assert delays == [0.5, 1.0, 2.0] and sup.restarts == 3
    assert "flaky exited with status 0, its 4th exit in 60s" in str(e.value)


def test_exits_outside_the_window_are_forgiven(tmp_path: Path) -> None:
    child = _FakeChild(tmp_path, 0).start()
    now = [0.0]
    sup = Supervisor(lambda: [child], out=io.StringIO(), max_restarts=2, window_s=10, clock=lambda: now[0])
    for _ in range(6):  # one exit every 20 s never loops
        assert child.proc is not None
        child.proc.wait(5)
        sup.poll()
        now[0] += 20
        sup.poll()
    assert sup.restarts == 6


def test_a_worker_alive_but_not_answering_leaves_rotation_and_is_restarted(tmp_path: Path) -> None:
    """Issue 27, item 2: a worker whose event loop is stuck (here SIGSTOP) kept getting decisions from
    Envoy - each one a 503 after the message timeout - and was never restarted. Envoy's health check
    now takes it out of rotation within two missed checks, and the supervisor kills and restarts it."""
    from tests.conftest import DEMO_KEYS, start_stack

    stack = start_stack(tmp_path / "state", workers=2)
    try:
        stuck = stack.extprocs[0]
        assert stuck.proc is not None
        old_pid = stuck.proc.pid
        out = io.StringIO()
        sup = Supervisor(stack.children, out=out, probe_every_s=0.2, probe_failures=3)
        sup.poll()  # it answers: from now on, misses count
        stuck.signal(signal.SIGSTOP)
        time.sleep(5)  # two missed checks, each waiting 1 s, 1 s apart (with jitter)
        statuses = [request(f"{stack.url}/v1/chat/completions", "POST", {
            "model": "chat-default", "max_tokens": 2, "messages": [{"role": "user", "content": f"hi {i}"}]},
            {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=10).status for i in range(12)]
        assert statuses == [200] * 12  # the stuck worker got none of them

        def restarted() -> bool:
            try:
                return stuck.proc is not None and stuck.proc.pid != old_pid and stack._serves_revision(
                    stack.status_urls[0])
            except OSError:
                return False
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not restarted():
            sup.poll()
            time.sleep(0.2)
        assert restarted() and "did not answer its health probe" in out.getvalue(), out.getvalue()
    finally:
        stack.stop()


class _Probed:
    """A running child whose probe answers as told."""

    def __init__(self) -> None:
        self.name, self.log_path, self.alive, self.answers, self.signals = "w", Path("w.log"), True, True, []
        self.proc = None
        self.probe = lambda: self.answers

    def signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_the_supervisor_kills_a_child_after_its_probe_fails_in_a_row() -> None:
    child = _Probed()
    now = [0.0]
    sup = Supervisor(lambda: [child], out=io.StringIO(), clock=lambda: now[0],  # type: ignore[arg-type, list-item]
                     probe_every_s=1.0, probe_failures=3, start_grace_s=5.0)
    for _ in range(4):  # just started: time to answer a first probe
        child.answers = False
        sup.poll()
        now[0] += 1.0
    assert child.signals == []
    for answers in (True, False, False, True, False, False):  # an answer in between resets the count
        child.answers = answers
        sup.poll()
        now[0] += 1.0
    assert child.signals == []
    sup.poll()  # the third miss in a row
    assert child.signals == [signal.SIGKILL]
    sup.poll()  # probed at most once a second
    assert child.signals == [signal.SIGKILL]
