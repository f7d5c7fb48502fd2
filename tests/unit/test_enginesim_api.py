"""The simulator speaks vLLM's OpenAI-compatible API, errors and metrics (real HTTP, own process)."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from enginesim.server import DEV_MODE_ENV, EngineServer, build_engine
from llmgw.bench.run import reset_prefix_caches
from llmgw.local.procs import Child, free_port, http_ok, python_module, wait_until
from tests.helpers import chat_body, request

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = Path(tmp_path_factory.mktemp("engine")) / "engine.log"
    # --fault-header: these tests inject faults per request; behind the gateway only the admin API can.
    child = Child("engine", python_module("enginesim", "--port", str(port), "--time-scale", "0.02",
                                          "--max-model-len", "4096", "--fault-header"), log,
                  env={DEV_MODE_ENV: "1"}).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
    yield url
    child.stop()


def sse_events(body: bytes) -> list[str]:
    return [e for e in body.decode().split("\n\n") if e]


def test_health_is_empty_200(engine: str) -> None:
    r = request(f"{engine}/health")
    assert r.status == 200 and r.body == b""


def test_models(engine: str) -> None:
    doc = request(f"{engine}/v1/models").json()
    assert doc["object"] == "list" and doc["data"][0]["id"] == MODEL
    assert doc["data"][0]["max_model_len"] == 4096


def test_non_streaming_shape(engine: str) -> None:
    r = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=5),
                {"X-Request-Id": "abc123"})
    doc = r.json()
    assert doc["id"] == "chatcmpl-abc123" and doc["object"] == "chat.completion" and doc["model"] == MODEL
    choice = doc["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 5
    assert doc["usage"]["total_tokens"] == doc["usage"]["prompt_tokens"] + 5
    (logged,) = [e for e in request(f"{engine}/admin/requests").json() if e["request_id"] == "abc123"]
    assert logged["output_tokens"] == 5 and 0 < logged["ttft_s"] < 1.0  # simulated seconds


def test_streaming_chunks_usage_and_done(engine: str) -> None:
    r = request(f"{engine}/v1/chat/completions", "POST",
                chat_body(MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.body)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 4 and content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_streaming_without_usage_has_no_usage_chunk(engine: str) -> None:
    r = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=3, stream=True))
    chunks = [json.loads(e[6:]) for e in sse_events(r.body)[:-1]]
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize(("body", "status", "param", "starts"), [
    (chat_body("other-model"), 404, "model", "The model `other-model` does not exist."),
    (chat_body(MODEL, max_tokens=100_000), 400, "max_tokens", "max_tokens=100000 cannot be greater than"),
    (chat_body(MODEL, "word " * 5000, max_tokens=10), 400, "input_tokens",
     "This model's maximum context length is 4096"),
    (chat_body(MODEL, cache_salt=""), 400, "cache_salt", "Parameter 'cache_salt'"),
    (chat_body(MODEL, max_tokens=0), 400, "max_tokens", "max_tokens must be at least 1"),
])
def test_vllm_error_bodies(engine: str, body: dict, status: int, param: str, starts: str) -> None:  # type: ignore[type-arg]
    r = request(f"{engine}/v1/chat/completions", "POST", body)
    assert r.status == status
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"].startswith(starts)
    assert err["type"] in ("BadRequestError", "NotFoundError")


def test_generation_stops_at_the_context_window(engine: str) -> None:
    # vLLM 0.32 does not refuse prompt + max_tokens over the window: it stops there with "length".
    prompt = "word " * 1000
    tokenized = request(f"{engine}/tokenize", "POST", {"messages": [{"role": "user", "content": prompt}]})
    n_prompt = tokenized.json()["count"]
    doc = request(f"{engine}/v1/chat/completions", "POST",
                  chat_body(MODEL, prompt, max_tokens=4000, seed=1)).json()
    assert doc["usage"]["total_tokens"] <= 4096
    assert doc["usage"]["prompt_tokens"] == n_prompt


def test_tokenize(engine: str) -> None:
    doc = request(f"{engine}/tokenize", "POST", {"prompt": "hello world"}).json()
    assert doc["count"] == len(doc["tokens"]) == 2 and doc["max_model_len"] == 4096


def test_metrics_use_vllm_names(engine: str) -> None:
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=2))
    text = request(f"{engine}/metrics").body.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "vllm:cache_config_info", "vllm:generation_tokens_total"):
        assert name in text, name
    assert f'model_name="{MODEL}"' in text
    assert "vllm:gpu_cache_usage_perc" not in text  # removed in vLLM 0.12


def prefix_hits(engine: str) -> float:
    for line in request(f"{engine}/metrics").body.decode().splitlines():
        if line.startswith("vllm:prefix_cache_hits_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no hits metric")


def test_same_prompt_and_salt_hits_prefix_cache(engine: str) -> None:
    def hits() -> float:
        return prefix_hits(engine)

    long = "shared system prompt " * 80
    base = hits()
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="a"))
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="a"))
    after_a = hits()
    assert after_a - base >= 160
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="b"))
    assert hits() == after_a


def test_reset_prefix_cache_makes_the_next_request_cold(engine: str) -> None:
    def hits() -> float:
        return prefix_hits(engine)

    long = "a prompt to forget " * 80
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="r"))
    reset = request(f"{engine}/reset_prefix_cache", "POST")
    assert reset.status == 200 and reset.json() == {"success": True}  # vLLM 0.32's answer
    before = hits()
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="r"))
    assert hits() == before  # cold: nothing of it was cached any more
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, long, max_tokens=1, cache_salt="r"))
    assert hits() - before >= 160  # and it caches again


def test_cache_reset_is_a_dev_mode_endpoint_as_in_vllm(tmp_path: Path) -> None:
    """vLLM 0.32 registers POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (a benchmark
    found the simulator answering it always)."""
    port = free_port()
    child = Child("engine", python_module("enginesim", "--port", str(port)), tmp_path / "engine.log",
                  env={DEV_MODE_ENV: "0"}).start()
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 30, "enginesim", child)
        assert request(f"http://127.0.0.1:{port}/reset_prefix_cache", "POST").status == 404
        # A benchmark's cold pass says which engine it could not empty, and why, instead of failing.
        (failed,) = reset_prefix_caches([f"http://127.0.0.1:{port}"])
        assert "VLLM_SERVER_DEV_MODE=1" in failed
    finally:
        child.stop()


@pytest.mark.parametrize("status", [429, 500, 503])
def test_fault_status_before_headers(engine: str, status: int) -> None:
    r = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL), {"x-enginesim-fault": f"status={status}"})
    assert r.status == status and r.json()["error"]["code"] == status


def test_fault_malformed_chunk(engine: str) -> None:
    r = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=10, stream=True),
                {"x-enginesim-fault": "malformed_after=2"})
    events = sse_events(r.body)
    assert len(events) == 4  # role chunk, two tokens, then the broken one
    with pytest.raises(json.JSONDecodeError):
        json.loads(events[-1][6:])


def test_fault_disconnect_mid_stream(engine: str) -> None:
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=50, stream=True),
                {"x-enginesim-fault": "disconnect_after=2"})


def test_fault_disconnect_before_a_json_answers_headers_after_the_work(engine: str) -> None:
    with pytest.raises((http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionError)):
        request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=5),
                {"x-enginesim-fault": "disconnect_after=0"})
    assert request(f"{engine}/admin/requests").json()[-1]["output_tokens"] == 5  # generated whole, never sent


def test_fault_queued_by_admin_endpoint(engine: str) -> None:
    assert request(f"{engine}/admin/faults", "POST", {"fault": "status=503", "count": 1}).status == 200
    assert request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL)).status == 503
    assert request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=1)).status == 200


def test_delay_before_headers(engine: str) -> None:
    import time
    t0 = time.monotonic()
    request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=1),
            {"x-enginesim-fault": "delay_ms=300"})
    assert time.monotonic() - t0 >= 0.3


def test_same_seed_same_text(engine: str) -> None:
    a = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, "x", max_tokens=10, seed=7)).json()
    b = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, "y", max_tokens=10, seed=7)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def _metric(engine: str, prefix: str) -> float:
    for line in request(f"{engine}/metrics").body.decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {prefix}")


def test_fault_stall_goes_silent_mid_stream(engine: str) -> None:
    import socket
    with pytest.raises((TimeoutError, socket.timeout)):
        request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=50, stream=True),
                {"x-enginesim-fault": "stall_after=2"}, timeout=1.0)


def test_client_cancel_aborts_the_request_in_the_engine(tmp_path: Path) -> None:
    """What vLLM 0.32 shows: generation stops and the request leaves the batch; the abort is not
    counted in request_success_total."""
    import socket
    import time
    port = free_port()
    # Real time (scale 1): 2,000 tokens take ~20 s, so only an abort can end this request early.
    child = Child("engine", python_module("enginesim", "--port", str(port)), tmp_path / "e.log").start()
    engine = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_ok(f"{engine}/health"), 30, "enginesim", child)
        body = json.dumps(chat_body(MODEL, max_tokens=2000, stream=True)).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            assert _metric(engine, "vllm:num_requests_running{") == 1
        deadline = time.monotonic() + 10
        while _metric(engine, "vllm:num_requests_running{") == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(engine, "vllm:num_requests_running{") == 0
        assert _metric(engine, "vllm:generation_tokens_total{") < 500  # far short of 2,000
        assert _metric(engine, "vllm:kv_cache_usage_perc{") == 0.0  # its blocks were freed
        assert all(line.endswith(" 0") for line in request(f"{engine}/metrics").body.decode().splitlines()
                   if line.startswith("vllm:request_success_total{"))
    finally:
        child.stop()


def test_faults_are_the_operators_alone(tmp_path: Path) -> None:
    """Started as `llmgw up` starts it (no --fault-header), a client's fault header does nothing; the
    exit fault needs the admin API, and a queued fault with `match` takes only requests naming it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = Child("engine", python_module("enginesim", "--port", str(port), "--time-scale", "0.02"),
                  tmp_path / "e.log").start()
    try:
        wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
        r = request(f"{url}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=2), {"x-enginesim-fault": "exit"})
        assert r.status == 200 and child.alive
        assert request(f"{url}/admin/faults", "POST", {"fault": "status=503", "match": "MARK-1"}).status == 200
        assert request(f"{url}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=2)).status == 200
        assert request(f"{url}/v1/chat/completions", "POST",
                       chat_body(MODEL, content="hi MARK-1", max_tokens=2)).status == 503
        assert request(f"{url}/admin/faults", "POST", {"fault": "exit"}).status == 200
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            request(f"{url}/v1/chat/completions", "POST", chat_body(MODEL))
        assert child.proc is not None and child.proc.wait(10) == 3
    finally:
        child.stop()


def test_n_completions_like_vllm(engine: str) -> None:
    """`n` choices of one prompt: indexes 0..n-1, the prompt counted once and the completions summed,
    in JSON and in a stream (each choice's chunks carry its index)."""
    doc = request(f"{engine}/v1/chat/completions", "POST", chat_body(MODEL, max_tokens=4, n=3, ignore_eos=True)).json()
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    usage = doc["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12
    r = request(f"{engine}/v1/chat/completions", "POST", chat_body(
        MODEL, max_tokens=4, n=2, ignore_eos=True, stream=True, stream_options={"include_usage": True}))
    events = [json.loads(e.removeprefix("data: ")) for e in sse_events(r.body) if e != "data: [DONE]"]
    content = [c["index"] for e in events for c in e["choices"] if c["delta"].get("content")]
    assert sorted(content) == [0] * 4 + [1] * 4
    assert events[-1]["usage"]["completion_tokens"] == 8 and sse_events(r.body)[-1] == "data: [DONE]"


@pytest.mark.parametrize("gone", [asyncio.CancelledError(), aiohttp.ClientConnectionResetError("closing transport")])
def test_a_client_gone_is_logged_cancelled_however_the_server_learned_it(gone: BaseException) -> None:
    """Its handler cancelled, or a write failing on the closed connection (the client closed while the
    handler was about to write: seen under load in a conformance run): either way the request's log
    entry says `cancelled`, which the conformance corpus's stream-cancelled case reads."""
    server = EngineServer(build_engine("llama-3-8b@h100", 0.02, True), MODEL)
    server.requests.append({"request_id": "rid-1"})

    async def handler(_: web.Request) -> web.StreamResponse:
        raise gone

    with pytest.raises(type(gone)):
        asyncio.run(server._cancellations(make_mocked_request("POST", "/", headers={"X-Request-Id": "rid-1"}),
                                          handler))
    assert server.requests[-1].get("cancelled") is True
