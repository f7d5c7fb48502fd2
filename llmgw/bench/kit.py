"""What the benchmarks, the chaos table and the comparisons share: an Envoy that answers like an engine
(the upstream every benchmark measures against), a bare Envoy beside the gateway, wrk and its
parsing, the sandbox policy with the evidence `llmgw up` earns, LiteLLM as the peer, and the report."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format

from extproc.config import Snapshot, load_snapshot
from extproc.names import Filter
from llmgw.conformance import demo_evidence
from llmgw.local.procs import Child, cpu_seconds, envoy_binary, envoy_env, free_port, http_ok, wait_until
from llmgw.local.sandbox import sandbox_policy
from llmgw.local.stack import StackOptions
from llmgw.render.bootstrap import duration_ms, pack, socket_address, static_cluster

COMPLETION = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})
_CHUNKS = (
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]},
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]},
)
_USAGE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [],
          "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}
SSE = "".join(f"data: {json.dumps(c)}\n\n" for c in _CHUNKS) + "data: [DONE]\n\n"
SSE_WITH_USAGE = "".join(f"data: {json.dumps(c)}\n\n" for c in (*_CHUNKS, _USAGE)) + "data: [DONE]\n\n"
# A request that offers tools gets a call of the first one the benchmark offers (its arguments satisfy
# BENCH_TOOL's schema), so the gateway's answer checks run in full.
BENCH_TOOL = {"type": "function", "function": {"name": "search_docs", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 64}}, "required": ["q"]}}}
_CALL = {"id": "call-bench", "type": "function", "function": {"name": "search_docs", "arguments": '{"q": "tokens"}'}}
CALL_COMPLETION = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                 "finish_reason": "tool_calls"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}})
_CALL_CHUNKS = (
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": [{**_CALL, "index": 0, "function": {"name": "search_docs",
                                                                                 "arguments": '{"q": '}}]},
         "finish_reason": None}]},
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"tokens"}'}}]},
         "finish_reason": None}]},
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
)
CALL_SSE = "".join(f"data: {json.dumps(c)}\n\n" for c in (*_CALL_CHUNKS, _USAGE)) + "data: [DONE]\n\n"
# The fake engine answers a stream request (`"stream": true` in the body, as vLLM reads it) in SSE,
# with the usage chunk when `include_usage` asks for it; every other request gets COMPLETION (a call
# when the request offers tools).
UPSTREAM_LUA = f"""
function envoy_on_request(h)
  local body = h:body()
  local text = body and body:getBytes(0, body:length()) or ""
  local tools = string.find(text, '"tools"', 1, true)
  if string.find(text, '"stream"%s*:%s*true') then
    local usage = string.find(text, '"include_usage"%s*:%s*true')
    h:respond({{[":status"] = "200", ["content-type"] = "text/event-stream"}},
              tools and [==[{CALL_SSE}]==] or usage and [==[{SSE_WITH_USAGE}]==] or [==[{SSE}]==])
  elseif tools then
    h:respond({{[":status"] = "200", ["content-type"] = "application/json"}}, [==[{CALL_COMPLETION}]==])
  end
end
"""


def _hcm(routes: list[route_components_pb2.Route], lua: str = "") -> listener_components_pb2.Filter:
    first = [hcm_pb2.HttpFilter(name="envoy.filters.http.lua", typed_config=pack(lua_pb2.Lua(
        default_source_code=base_pb2.DataSource(inline_string=lua))))] if lua else []
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="bench", codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=route_pb2.RouteConfiguration(virtual_hosts=[route_components_pb2.VirtualHost(
            name="all", domains=["*"], routes=routes)]),
        http_filters=[*first,
                      hcm_pb2.HttpFilter(name=Filter.ROUTER, typed_config=pack(router_pb2.Router()))])
    return listener_components_pb2.Filter(name=Filter.HTTP_CONNECTION_MANAGER, typed_config=pack(hcm))


def _direct(body: str, content_type: str) -> route_components_pb2.Route:
    match = route_components_pb2.RouteMatch(prefix="/")
    return route_components_pb2.Route(
        match=match, direct_response=route_components_pb2.DirectResponseAction(
            status=200, body=base_pb2.DataSource(inline_string=body)),
        response_headers_to_add=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="content-type", value=content_type))])


# A vLLM metrics page, so the gateway's endpoint picker scores the fake engine on every request.
METRICS = "".join(f'{name}{{engine="0",model_name="bench"}} {value}\n' for name, value in (
    ("vllm:num_requests_running", 0.0), ("vllm:num_requests_waiting", 0.0), ("vllm:kv_cache_usage_perc", 0.0)))


def upstream_bootstrap(port: int, admin: int) -> bootstrap_pb2.Bootstrap:
    """A fast fake engine: SSE when the request body asks for a stream, else JSON; /metrics answers
    like vLLM's."""
    metrics = _direct(METRICS, "text/plain")
    metrics.match.ClearField("prefix")
    metrics.match.path = "/metrics"
    routes = [metrics, _direct(COMPLETION, "application/json")]
    return bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=socket_address("127.0.0.1", admin)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(listeners=[listener_pb2.Listener(
            name="up", address=socket_address("127.0.0.1", port),
            filter_chains=[listener_components_pb2.FilterChain(filters=[_hcm(routes, UPSTREAM_LUA)])])]))


def bare_bootstrap(port: int, admin: int, upstream: int) -> bootstrap_pb2.Bootstrap:
    route = route_components_pb2.Route(match=route_components_pb2.RouteMatch(prefix="/"),
                                       route=route_components_pb2.RouteAction(cluster="up", timeout=duration_ms(0)))
    return bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=socket_address("127.0.0.1", admin)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[listener_pb2.Listener(name="bare", address=socket_address("127.0.0.1", port),
                                             filter_chains=[listener_components_pb2.FilterChain(
                                                 filters=[_hcm([route])])])],
            clusters=[static_cluster("up", [("127.0.0.1", upstream)], http2=False, connect_ms=1000)]))


def start_envoy(name: str, boot: bootstrap_pb2.Bootstrap, workdir: Path, admin: int) -> Child:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(json.loads(json_format.MessageToJson(boot, preserving_proto_field_name=True))))
    child = Child(name, [str(envoy_binary()), "-c", str(path), "--concurrency", "1", "--disable-hot-restart",
                         "--log-level", "error"], workdir / f"{name}.log", env=envoy_env()).start()
    wait_until(lambda: http_ok(f"http://127.0.0.1:{admin}/ready"), 30, name, child)
    return child


WRK_LUA = """
wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    non_2xx: int


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(text)
    v, unit = float(m.group(1)), m.group(2)
    return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v


def run_wrk(url: str, script: Path, connections: int, duration: float) -> Result:
    # A slow peer (LiteLLM at 32 connections) may take longer than wrk's default 2 s timeout per request.
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "10s", "--latency",
            "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60).stdout
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    timeouts = re.search(r"timeout (\d+)", out)
    # No answer at all within the run: no percentiles (nan), every try counted as failed.
    return Result(rps, _ms(lat["50"]) if "50" in lat else math.nan, _ms(lat["99"]) if "99" in lat else math.nan,
                  (int(bad.group(1)) if bad else 0) + (int(timeouts.group(1)) if timeouts else 0))


def measured_wrk(url: str, script: Path, connections: int, duration: float,
                 procs: dict[str, list[Child]]) -> tuple[Result, dict[str, float], float]:
    """One wrk round with what it cost: (its result, the CPU seconds each kind of process spent
    during it, the requests it served - its rate over the whole seconds wrk runs)."""
    before = cpu_seconds(procs)
    r = run_wrk(url, script, connections, duration)
    spent = {proc: sec - before.get(proc, 0.0) for proc, sec in cpu_seconds(procs).items()}
    return r, spent, r.rps * max(1, round(duration))


# The route every benchmark measures: the pool's (the demo policy's other routes reach hosted
# providers, which the benchmarks do not run).
POOL_ROUTE = "chat-default"


# Earned records the sandboxes reuse (llmgw/conformance/demo_evidence.py).
EVIDENCE_CACHE = Path(".llmgw") / "evidence-cache"


def demo_policy(src: Path, dst: Path) -> tuple[Path, dict[str, str]]:
    """A sandbox copy of the policy (benchmarks, chaos, comparisons) with the evidence `llmgw up` earns
    for the candidates it simulates (they are all simulated here)."""
    dst, keys = sandbox_policy(src, dst)
    simulated = demo_evidence.simulated_by_up(load_snapshot(dst), "sim", True)
    demo_evidence.ensure(dst, simulated, cache=EVIDENCE_CACHE, out=sys.stderr)
    return dst, keys


def without_quotas(dst: Path) -> Path:
    doc = yaml.safe_load((dst / "gateway.yaml").read_text())
    doc["quotas"] = []
    (dst / "gateway.yaml").write_text(yaml.safe_dump(doc))
    return dst


@dataclass
class Beside:
    """What a served-path benchmark measures the gateway beside: the fake engine (`upstream`), a bare
    Envoy in front of it, and the sandbox policy (without the per-minute quotas: a benchmark's rate is
    far above them and would measure 429s), in a work directory of its own."""

    work: Path
    config: Path
    keys: dict[str, str]
    snap: Snapshot
    upstream: Child
    bare: Child
    up_port: int
    bare_port: int

    @classmethod
    def start(cls, config_src: Path, prefix: str) -> Beside:
        work = Path(tempfile.mkdtemp(prefix=prefix))
        up_port, up_admin, bare_port, bare_admin = (free_port() for _ in range(4))
        config, keys = demo_policy(config_src, work / "policy")
        without_quotas(config)
        upstream = start_envoy("upstream", upstream_bootstrap(up_port, up_admin), work, up_admin)
        bare = start_envoy("bare", bare_bootstrap(bare_port, bare_admin, up_port), work, bare_admin)
        return cls(work, config, keys, load_snapshot(config), upstream, bare, up_port, bare_port)

    @property
    def bare_url(self) -> str:
        return f"http://127.0.0.1:{self.bare_port}/v1/chat/completions"

    def gateway_options(self, state: Path, workers: int) -> StackOptions:
        """A gateway on free ports whose pools are the fake engine: the whole pipeline, budgets included
        (so the store runs)."""
        opts = StackOptions.on_free_ports(self.config, state, self.snap, workers=workers, start_engines=False,
                                          envoy_concurrency=1)
        opts.engine_ports = {p: (self.up_port,) for p in self.snap.gateway.pools}
        return opts

    def stop(self) -> None:
        self.upstream.stop()
        self.bare.stop()


def wrk_missing() -> bool:
    if shutil.which("wrk") is None:
        print("error: wrk not found; install it (Debian: apt-get install wrk)")
        return True
    return False


LITELLM = "litellm[proxy]==1.108.7"  # the peer measured beside the gateway, in its own environment
LITELLM_KEY = "sk-llmgw-bench"  # its master key: it authenticates every request, as the gateway does


def litellm_proxy(work: Path, upstream: int, models: list[str], venv: Path) -> tuple[Child, int]:
    """LiteLLM's proxy (pinned, installed into `venv` on first use) in front of the same upstream,
    one worker, each route name an OpenAI-compatible model there."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "litellm").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", LITELLM], check=True)
    port = free_port()
    cfg = work / "litellm.yaml"
    cfg.write_text(yaml.safe_dump({"general_settings": {"master_key": LITELLM_KEY}, "model_list": [
        {"model_name": m, "litellm_params": {"model": f"openai/{m}", "api_base": f"http://127.0.0.1:{upstream}/v1",
                                             "api_key": "unused"}} for m in models]}))
    child = Child("litellm", [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1",
                              "--port", str(port), "--num_workers", "1"], work / "litellm.log").start()
    wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health/liveliness"), 180, "litellm", child)
    return child, port


def report(table: str, output: str | None) -> int:
    """A benchmark's markdown table: printed, and written to `output` when given."""
    print(table)
    if output:
        Path(output).write_text(table)
    return 0


