"""Hot reload (invariant 12) and TLS, through the real processes."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, start_stack
from tests.helpers import Response, assert_contract_error, chat_body, inject_fault, request

pytestmark = pytest.mark.e2e
AUTH = {"authorization": f"Bearer {DEMO_KEYS['globex']}"}  # globex refuses tools no entry lists
TOOL = [{"type": "function", "function": {"name": "search_docs"}}]


def status(stack: Stack) -> dict[str, Any]:
    return request(stack.status_urls[0]).json()  # type: ignore[no-any-return]


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.1)


def test_bad_revision_is_refused_and_good_one_swaps_without_dropping_in_flight(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    s = start_stack(tmp_path / "state", policy)
    try:
        old = s.snapshot.revision
        assert status(s)["revision"] == old
        chat = f"{s.url}/v1/chat/completions"

        # A broken Rego file: refused, reported, and the old revision keeps serving.
        (policy / "broken.rego").write_text("package llmgw.authz\nallow if {\n")
        wait_for(lambda: status(s)["refused"] >= 1)
        st = status(s)
        assert st["revision"] == old and any("policy does not compile" in e for e in st["last_error"])
        r = request(chat, "POST", chat_body(max_tokens=4, tools=TOOL), headers=AUTH)
        assert r.status == 200 and r.headers["x-llmgw-route-revision"] == old
        (policy / "broken.rego").unlink()

        # A request in flight (the engine holds it 2 s) while a good change lands.
        in_flight: list[Response] = []
        marker = inject_fault(s.engine_urls(), "delay_ms=2000")
        t = threading.Thread(target=lambda: in_flight.append(request(
            chat, "POST", chat_body(content=marker, max_tokens=4), headers=AUTH)))
        t.start()
        time.sleep(0.3)
        gw = yaml.safe_load((policy / "gateway.yaml").read_text())
        del gw["tools"]["search_docs"]  # the good change: the tool leaves the catalog
        (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
        wait_for(lambda: status(s)["revision"] != old)
        new = status(s)["revision"]
        r = request(chat, "POST", chat_body(max_tokens=4, tools=TOOL), headers=AUTH)
        assert "not in the tool catalog" in assert_contract_error(r, 403, "forbidden")["message"]
        assert r.headers["x-llmgw-route-revision"] == new
        assert t.is_alive(), "the in-flight request ended before the reload; the test proves nothing"
        t.join(10)
        (done,) = in_flight
        assert done.status == 200 and done.headers["x-llmgw-route-revision"] == old
        assert status(s)["last_error"] is None
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = start_stack(tmp_path_factory.mktemp("tls"), tls=True, require_client_certificate=True)
    yield s
    s.stop()


def https(stack: Stack, with_cert: bool) -> Response:
    certs = stack.opts.state_dir / "tls"
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if with_cert:
        ctx.load_cert_chain(certs / "client.crt", certs / "client.key")
    host, port = stack.render.listen
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat_body(max_tokens=4)),
                     headers={**AUTH, "content-type": "application/json"})
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


def test_tls_with_client_certificate_and_mtls_to_extproc(tls_stack: Stack) -> None:
    assert tls_stack.url.startswith("https://")
    r = https(tls_stack, with_cert=True)
    assert r.status == 200, r.body  # ext_proc decided over mTLS: the route needs its metadata
    assert r.json()["choices"][0]["message"]["content"]


def test_client_without_certificate_is_refused(tls_stack: Stack) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        https(tls_stack, with_cert=False)


def test_extproc_refuses_a_client_without_envoys_certificate(tls_stack: Stack) -> None:
    host, port = tls_stack.render.extproc[0]
    for channel in (grpc.insecure_channel(f"{host}:{port}"),
                    grpc.secure_channel(f"{host}:{port}", grpc.ssl_channel_credentials(
                        (tls_stack.opts.state_dir / "tls/ca.crt").read_bytes()),
                        options=[("grpc.ssl_target_name_override", "extproc.llmgw.internal")])):
        stub = ep_grpc.ExternalProcessorStub(channel)
        with pytest.raises(grpc.RpcError):
            list(stub.Process(iter([ep.ProcessingRequest()]), timeout=3))
        channel.close()
