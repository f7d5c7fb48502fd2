"""The gateway's local surfaces (issue 27, item 8): Envoy's admin interface and each worker's status
server answer only requests that name a loopback Host - a page in a local browser whose name resolves
to 127.0.0.1 cannot drive them - and the status server's POST /reload needs the admin token from the
state directory."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.local.stack import Stack
from tests.helpers import request

pytestmark = pytest.mark.e2e
EVIL = "rebind.example:8080"


def host_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0]


def test_envoys_admin_answers_only_a_loopback_host(stack: Stack) -> None:
    ok = request(f"{stack.admin_url}/ready", headers={"host": host_of(stack.admin_url)})
    assert ok.status == 200
    assert request(f"{stack.admin_url}/ready", headers={"host": "localhost"}).status == 200
    for method, path in (("GET", "/config_dump"), ("POST", "/quitquitquit"), ("POST", "/logging?level=trace")):
        r = request(f"{stack.admin_url}{path}", method, headers={"host": EVIL})
        assert r.status == 403 and b"loopback" in r.body, (path, r.status)
    assert stack.envoy is not None and stack.envoy.alive  # it did not quit
    assert request(f"{stack.admin_url}/ready").status == 200


def test_a_workers_status_server_answers_only_a_loopback_host(stack: Stack) -> None:
    status = stack.status_urls[0]
    assert request(status).status == 200
    assert request(status, headers={"host": EVIL}).status == 403
    assert request(status.replace("/status", "/metrics"), headers={"host": EVIL}).status == 403


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 401), ("right", 200)])
def test_reload_needs_the_admin_token(stack: Stack, token: str | None, status: int) -> None:
    headers: dict[str, Any] = {}
    if token is not None:
        value = stack.admin_token_file.read_text().strip() if token == "right" else token
        headers["authorization"] = f"Bearer {value}"
    r = request(stack.status_urls[0].replace("/status", "/reload"), "POST", b"", headers)
    assert r.status == status, r.body
    if status == 200:
        assert r.json()["revision"] == stack.snapshot.revision
    assert stack.admin_token_file.stat().st_mode & 0o077 == 0  # the owner's alone


def test_ext_proc_takes_questions_from_envoy_alone(stack: Stack) -> None:
    """Without TLS the workers listen on Unix sockets in an owner-only directory, not on TCP: a local
    process of another user cannot reach them to send access-log (settlement) records or decisions'
    questions. (With TLS they listen on TCP and admit only Envoy's certificate: tests/e2e/policy/test_reload_tls.py.)"""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    sockets = [Path(h.removeprefix("unix:")) for h, _ in stack.render.extproc]
    assert sockets and all(h.startswith("unix:") for h, _ in stack.render.extproc)
    for sock in sockets:
        assert sock.is_socket() and sock.parent.stat().st_mode & 0o077 == 0, oct(sock.parent.stat().st_mode)
    runuser = shutil.which("runuser")
    if os.geteuid() == 0 and runuser:  # as another user: the socket cannot even be reached
        seen = subprocess.run([runuser, "-u", "nobody", "--", "test", "-w", str(sockets[0])], check=False)
        assert seen.returncode != 0
