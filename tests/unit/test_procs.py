"""Free ports: never one twice, never one a command line named, only this process's slice."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from llmgw.local import procs


class _Kernel:
    """bind(0) answering from a fixed sequence of ports, as the kernel may (it reuses just-closed ones)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports: Iterator[int] = iter(ports)

    def __call__(self, *_: object) -> _Kernel:
        self.port = next(self.ports)
        return self

    def __enter__(self) -> _Kernel:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def bind(self, _: object) -> None:
        pass

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> _Kernel:
    monkeypatch.setattr(procs, "_handed_out", set())
    monkeypatch.setenv(procs.PORT_SLICE_ENV, "0/1")
    k = _Kernel([])
    monkeypatch.setattr(socket, "socket", k)
    return k


def test_a_port_is_never_handed_out_twice(kernel: _Kernel) -> None:
    kernel.ports = iter([40000, 40000, 40002])
    assert [procs.free_port(), procs.free_port()] == [40000, 40002]


def test_a_claimed_port_is_never_handed_out(kernel: _Kernel) -> None:
    # `llmgw up --free-ports --port P`: P was chosen free by the caller, and the kernel may offer it
    # again to this process before Envoy binds it.
    procs.claim_ports(40000, None)
    kernel.ports = iter([40000, 40002])
    assert procs.free_port() == 40002


def test_only_this_process_s_slice(kernel: _Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(procs.PORT_SLICE_ENV, "1/2")
    kernel.ports = iter([40000, 40001, 40002])  # (p // 2) % 2: 0, 0, 1
    assert procs.free_port() == 40002
