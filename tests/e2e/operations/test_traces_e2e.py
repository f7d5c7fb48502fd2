"""Traces (issue 14, part 1): an OTLP receiver in the test (opentelemetry-proto's gRPC service) gets the
gateway's spans over the real protocol. One server span per request, naming its ledger entry, across
outcomes (answered, streamed, fallback, refused); a client's trace is continued and reaches the engine
with the gateway's span as its parent; a fallback's two attempt spans are children of one request
span; no prompt and no credential in any span."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmgw.local.procs import free_port
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import inject_fault, request, stream_raw

pytestmark = pytest.mark.e2e
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CANARY = "canarytracezqx"
SERVER, CLIENT = 2, 3  # OTLP span kinds


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def Export(self, request: Any, context: Any) -> Any:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    self.spans.append({"trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                       "parent": s.parent_span_id.hex(), "name": s.name, "kind": s.kind,
                                       "attrs": attrs})
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def otlp_port() -> int:
    return free_port()


def traces_policy(tmp: Path) -> Path:
    """The demo policy, plus a budget that refuses globex on chat-gemini (a budget refusal's span)."""
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    doc["budgets"].append({"name": "globex-gemini-none", "tenant": "globex", "route": "chat-gemini",
                           "window": "total", "limit_tokens": 1})
    (policy / "gateway.yaml").write_text(yaml.safe_dump(doc))
    return policy


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, otlp_port: int) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("traces")
    s = start_stack(tmp / "state", traces_policy(tmp), simulate_providers=True,
                    extproc_env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def receiver(gw: Stack, otlp_port: int) -> Iterator[tuple[Receiver, int]]:
    """Started after the gateway's processes: a gRPC server's threads in this process would otherwise
    run gRPC's fork handlers in each child the stack forks, which sometimes killed one at start."""
    r = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    server.add_insecure_port(f"127.0.0.1:{otlp_port}")
    server.start()
    yield r, otlp_port
    server.stop(0)


def chat(gw: Stack, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return request(f"{gw.url}/v1/chat/completions", "POST", body,
                   {"authorization": f"Bearer {DEMO_KEYS['acme']}", **(headers or {})})


def spans_of(receiver: Receiver, rid: str, count: int = 1, timeout: float = 15) -> list[dict[str, Any]]:
    """The spans naming ledger entry `rid`, once at least `count` arrived."""
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in receiver.spans if s["attrs"].get("llmgw.ledger.request_id") == rid]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_clients_trace_is_continued_to_the_engine_under_the_gateways_span(
        gw: Stack, receiver: tuple[Receiver, int]) -> None:
    r = chat(gw, {"model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": CANARY}]},
             {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status == 200, r.body
    rid = r.headers["x-request-id"]
    entry = ledger_of(gw, rid, "acme")
    (span,) = spans_of(receiver[0], rid)
    assert span["trace"] == CLIENT_TRACE == entry["trace_id"] and span["parent"] == CLIENT_SPAN
    assert span["kind"] == SERVER and span["name"] == "chat chat-default"
    a = span["attrs"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "self-hosted"
    assert a["gen_ai.request.model"] == "chat-default" and a["gen_ai.usage.output_tokens"] == 4
    assert a["llmgw.termination"] == "complete" and a["llmgw.deployment"] == "pool-llama-8b"
    assert "gen_ai.system" not in a  # the retired attribute
    engines = [e for u in gw.engine_urls() for e in request(f"{u}/admin/requests").json()
               if CANARY in str(e["messages"])]
    (sent,) = engines
    assert sent["headers"]["traceparent"] == f"00-{CLIENT_TRACE}-{span['id']}-01"  # the gateway's span: parent


def test_a_fallbacks_two_attempts_are_children_of_one_request_span(gw: Stack, receiver: tuple[Receiver, int]) -> None:
    marker = inject_fault(gw.engine_urls("engine-pool"), "status=503", count=4)
    r = chat(gw, {"model": "chat-fallback", "max_tokens": 4, "messages": [{"role": "user", "content": marker}]})
    assert r.status == 200 and r.headers["x-llmgw-attempts"] == "2", r.body
    rid = r.headers["x-request-id"]
    spans = spans_of(receiver[0], rid, count=3)
    (root,) = [s for s in spans if s["kind"] == SERVER]
    attempts = sorted((s for s in spans if s["kind"] == CLIENT), key=lambda s: s["attrs"]["llmgw.attempt.n"])
    assert [s["attrs"]["llmgw.attempt.kind"] for s in attempts] == ["first", "model_fallback"]
    assert all(s["parent"] == root["id"] and s["trace"] == root["trace"] for s in attempts)
    assert [s["attrs"]["http.response.status_code"] for s in attempts] == [503, 200]
    assert root["attrs"]["llmgw.deployment"] == "demo-anthropic" and root["parent"] == ""  # a new trace


def test_every_outcome_has_one_span_and_no_content_or_credential(gw: Stack, receiver: tuple[Receiver, int]) -> None:
    streamed = chat(gw, {"model": "chat-default", "max_tokens": 4, "stream": True,
                         "messages": [{"role": "user", "content": f"{CANARY} stream"}]})
    refused = chat(gw, {"model": "chat-anthropic", "max_tokens": 4, "seed": 3,  # the Messages API has no seed
                        "messages": [{"role": "user", "content": f"{CANARY} refused"}]})
    assert streamed.status == 200 and refused.status == 400
    (s,) = spans_of(receiver[0], streamed.headers["x-request-id"])
    assert s["attrs"]["llmgw.stream"] is True and s["attrs"]["llmgw.termination"] == "complete"
    (f,) = spans_of(receiver[0], refused.headers["x-request-id"])
    assert f["attrs"]["error.type"] == "unsupported_field" and f["attrs"]["llmgw.termination"] == "refused"
    time.sleep(1)  # anything late would have come by now
    by_request: dict[str, int] = {}
    for span in receiver[0].spans:
        if span["kind"] == SERVER:
            rid = span["attrs"]["llmgw.ledger.request_id"]
            by_request[rid] = by_request.get(rid, 0) + 1
        text = repr(span)
        assert CANARY not in text and DEMO_KEYS["acme"] not in text
    assert by_request and set(by_request.values()) == {1}  # one request span per request


def test_each_outcome_has_one_ledger_entry_and_one_span_naming_it(gw: Stack, receiver: tuple[Receiver, int]) -> None:
    """Denied, refused by budget, upstream failure, deadline, client cancel and stream interruption
    (success, fallback and an intake refusal above; a request whose worker died: tests/unit/test_store.py)."""
    pool = gw.engine_urls("engine-pool")
    seen: dict[str, tuple[str, str]] = {}  # outcome -> (tenant, request id)

    def outcome(name: str, r: Any, tenant: str = "acme") -> None:
        seen[name] = (tenant, r.headers["x-request-id"])

    body = {"model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    outcome("denied", chat(gw, body, {"x-llmgw-data-class": "restricted"}))
    outcome("budget", request(f"{gw.url}/v1/chat/completions", "POST", {**body, "model": "chat-gemini"},
                              {"authorization": f"Bearer {DEMO_KEYS['globex']}"}), "globex")
    marker = inject_fault(pool, "status=500", count=4)
    outcome("upstream", chat(gw, {**body, "messages": [{"role": "user", "content": marker}]}))
    marker = inject_fault(pool, "delay_ms=3000")
    outcome("deadline", chat(gw, {**body, "messages": [{"role": "user", "content": marker}]},
                             {"x-llmgw-deadline-ms": "300"}))
    marker = inject_fault(pool, "disconnect_after=2")
    _, rid, _ = stream_raw(f"{gw.url}/v1/chat/completions", {**body, "stream": True, "messages": [
        {"role": "user", "content": marker}]}, {"authorization": f"Bearer {DEMO_KEYS['acme']}"})
    seen["interrupted"] = ("acme", rid)
    cancel = inject_fault(pool, "delay_ms=2000")
    with pytest.raises((TimeoutError, socket.timeout)):
        request(f"{gw.url}/v1/chat/completions", "POST", {**body, "messages": [{"role": "user", "content": cancel}]},
                {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=0.5)
    (sent,) = [e for u in pool for e in request(f"{u}/admin/requests").json() if cancel in str(e["messages"])]
    seen["client_cancel"] = ("acme", sent["request_id"])
    expected = {"denied": "denied", "budget": "refused", "upstream": "upstream_error", "deadline": "deadline",
                "interrupted": "stream_interrupted", "client_cancel": "client_cancel"}
    for name, (tenant, rid) in seen.items():
        entry = ledger_of(gw, rid, tenant)  # exactly one
        servers = [s for s in spans_of(receiver[0], rid) if s["kind"] == SERVER]
        assert len(servers) == 1, (name, servers)
        (span,) = servers
        assert span["trace"] == entry["trace_id"], name
        assert entry["termination"] == span["attrs"]["llmgw.termination"] == expected[name], (name, entry)
