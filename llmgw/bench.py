"""`llmgw bench overhead`: what the gateway adds over bare Envoy, measured in one run.

Three Envoys on loopback, one configuration style:
  upstream  answers every chat completion itself (direct response: JSON, or SSE for stream=true),
            so the upstream costs the same microseconds in both conditions;
  bare      a plain proxy to that upstream: the baseline;
  gateway   `llmgw envoy render` output with the pool pointed at the same upstream, plus ext_proc.
wrk drives both proxies with the same request, alternating between them round by round so that
drift on the shared 2-core machine hits both alike. Figures: p50/p99 latency and requests/s.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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

from extproc.config import load_snapshot
from llmgw.demo_keys import ensure_demo_keys
from llmgw.envoy_render import duration_ms, pack, socket_address, static_cluster
from llmgw.procs import Child, cpu_seconds, envoy_binary, envoy_env, free_port, http_ok, wait_until, wakeups
from llmgw.stack import Stack, StackOptions, gateway_processes

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
# The fake engine answers a stream request (`"stream": true` in the body, as vLLM reads it) in SSE,
# with the usage chunk when `include_usage` asks for it; every other request gets COMPLETION.
UPSTREAM_LUA = f"""
function envoy_on_request(h)
  local body = h:body()
  local text = body and body:getBytes(0, body:length()) or ""
  if string.find(text, '"stream"%s*:%s*true') then
    local usage = string.find(text, '"include_usage"%s*:%s*true')
    h:respond({{[":status"] = "200", ["content-type"] = "text/event-stream"}},
              usage and [==[{SSE_WITH_USAGE}]==] or [==[{SSE}]==])
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
                      hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=pack(router_pb2.Router()))])
    return listener_components_pb2.Filter(name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm))


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


def _start_envoy(name: str, boot: bootstrap_pb2.Bootstrap, workdir: Path, admin: int) -> Child:
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
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60).stdout
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return Result(rps, _ms(lat["50"]), _ms(lat["99"]), int(bad.group(1)) if bad else 0)


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


EVIDENCE_CACHE = Path(".llmgw") / "evidence-cache"  # earned records the sandboxes reuse (llmgw/demo_evidence.py)


def demo_policy(src: Path, dst: Path, evidence: bool = True) -> tuple[Path, dict[str, str]]:
    """A copy of the policy to run a sandboxed gateway on (benchmarks, chaos, comparisons), with a demo
    key for each tenant that has none and, unless `evidence` is False, the evidence `llmgw up` earns
    for the candidates it simulates (they are all simulated here)."""
    shutil.copytree(src, dst)
    keys, _ = ensure_demo_keys(dst, dst.parent / f"{dst.name}-keys")
    if evidence:
        from llmgw import demo_evidence  # it runs the conformance sandbox, which builds on this function

        simulated = demo_evidence.simulated_by_up(load_snapshot(dst), "sim", True)
        demo_evidence.ensure(dst, simulated, cache=EVIDENCE_CACHE, out=sys.stderr)
    return dst, keys


def without_quotas(dst: Path) -> Path:
    doc = yaml.safe_load((dst / "gateway.yaml").read_text())
    doc["quotas"] = []
    (dst / "gateway.yaml").write_text(yaml.safe_dump(doc))
    return dst


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


def run_overhead(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("error: wrk not found; install it (Debian: apt-get install wrk)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    up_port, up_admin, bare_port, bare_admin = (free_port() for _ in range(4))
    config, keys = demo_policy(Path(args.config), work / "policy")
    without_quotas(config)
    snap = load_snapshot(config)
    children = [_start_envoy("upstream", upstream_bootstrap(up_port, up_admin), work, up_admin),
                _start_envoy("bare", bare_bootstrap(bare_port, bare_admin, up_port), work, bare_admin)]
    # The whole pipeline, budgets included (so the store runs); only the demo tenant's per-minute
    # quota is dropped: a benchmark's rate is far above it and would measure 429s.
    opts = StackOptions.on_free_ports(config, work / "gw", snap, workers=args.workers,
                                      start_engines=False, envoy_concurrency=1)
    opts.engine_ports = {p: (up_port,) for p in snap.gateway.pools}
    stack = Stack(opts)
    rows: list[str] = []
    try:
        stack.start()
        urls = {"bare": f"http://127.0.0.1:{bare_port}/v1/chat/completions",
                "gateway": f"{stack.url}/v1/chat/completions"}
        procs: dict[str, dict[str, list[Child]]] = {"bare": {"envoy": [children[1]]},
                                                     "gateway": gateway_processes(stack)}
        if args.litellm:
            peer, port = litellm_proxy(work, up_port, list(snap.routes), Path(args.litellm_venv))
            children.append(peer)
            urls["litellm"] = f"http://127.0.0.1:{port}/v1/chat/completions"
            procs["litellm"] = {"litellm": [peer]}
        key = keys["acme"]
        body = json.dumps({"model": POOL_ROUTE, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
        for stream in (False, True):
            scripts = {}
            for name in urls:
                doc = {**json.loads(body), **({"stream": True} if stream else {})}
                scripts[name] = work / f"req-{name}-{stream}.lua"
                scripts[name].write_text(WRK_LUA.format(body=json.dumps(doc),
                                                        key=LITELLM_KEY if name == "litellm" else key))
            for c in (int(x) for x in args.concurrency.split(",")):
                got: dict[str, list[Result]] = {name: [] for name in urls}
                cpu: dict[str, dict[str, float]] = {name: {} for name in urls}
                woken: dict[str, dict[str, float]] = {name: {} for name in urls}
                for name, url in urls.items():
                    run_wrk(url, scripts[name], c, 2)  # warm-up
                for _ in range(args.rounds):
                    for name, url in urls.items():
                        before, switches = cpu_seconds(procs[name]), wakeups(procs[name])
                        got[name].append(run_wrk(url, scripts[name], c, args.duration / args.rounds))
                        for proc, sec in cpu_seconds(procs[name]).items():
                            cpu[name][proc] = cpu[name].get(proc, 0.0) + sec - before.get(proc, 0.0)
                        for proc, n in wakeups(procs[name]).items():
                            woken[name][proc] = woken[name].get(proc, 0.0) + n - switches.get(proc, 0)
                secs = max(1, round(args.duration / args.rounds))  # what run_wrk runs for
                rows.append(_row("stream" if stream else "json", c, got, cpu, secs, woken))
                print(rows[-1], flush=True)
        picked = _picked_share(stack.logs / "envoy.log", f"127.0.0.1:{up_port}")
    finally:
        stack.stop()
        for ch in children:
            ch.stop()
    table = _table(rows, args) + f"Endpoint picker named the engine on {picked:.0%} of the gateway's requests.\n"
    if args.token_streams:
        from llmgw.bench_stream import measure_token_streams

        table += "\nStreams of one event per token (`llmgw bench stream`, defaults):\n\n"
        table += measure_token_streams(argparse.Namespace(
            config=args.config, streams=48, tokens=256, gap_ms=10.0, concurrency=8, rounds=3, workers=args.workers,
            output=None))
    return report(table, args.output)


def report(table: str, output: str | None) -> int:
    """A benchmark's markdown table: printed, and written to `output` when given."""
    print(table)
    if output:
        Path(output).write_text(table)
    return 0


def _picked_share(envoy_log: Path, engine: str) -> float:
    """Share of access-log lines in which the picker's order named the engine (it scored it)."""
    lines = [json.loads(ln) for ln in envoy_log.read_text().splitlines() if ln.startswith("{")]
    return sum(1 for ln in lines if ln.get("picked") == engine) / max(1, len(lines))


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _row(kind: str, c: int, got: dict[str, list[Result]], cpu: dict[str, dict[str, float]], secs: int,
         woken: dict[str, dict[str, float]]) -> str:
    """Medians of the rounds; CPU (us) and wake-ups (context switches) per request from each
    process's counters over the requests served."""
    bare, gw = got["bare"], got["gateway"]
    b50, g50 = _med([r.p50_ms for r in bare]), _med([r.p50_ms for r in gw])
    brps, grps = _med([r.rps for r in bare]), _med([r.rps for r in gw])
    errors = sum(r.non_2xx for r in bare + gw)

    def per_request(counters: dict[str, dict[str, float]], name: str) -> dict[str, float]:
        served = max(1.0, sum(r.rps * secs for r in got[name]))
        return {proc: n / served for proc, n in counters[name].items()}
    gcpu = {proc: s * 1e6 for proc, s in per_request(cpu, "gateway").items()}
    bcpu = {proc: s * 1e6 for proc, s in per_request(cpu, "bare").items()}
    gwake, bwake = per_request(woken, "gateway"), sum(per_request(woken, "bare").values())
    row = (f"| {kind} | {c} | {b50:.3f} | {g50:.3f} | +{g50 - b50:.3f} | {brps:,.0f} | {grps:,.0f} | {grps / brps:.1%} "
           f"| {bcpu.get('envoy', 0):.0f} | {gcpu.get('envoy', 0):.0f} / {gcpu.get('ext_proc', 0):.0f} / "
           f"{gcpu.get('store', 0):.0f} | {sum(gcpu.values()) / max(1.0, sum(bcpu.values())):.1f}x "
           f"| {bwake:.1f} | {gwake.get('envoy', 0):.1f} / {gwake.get('ext_proc', 0):.1f} / "
           f"{gwake.get('store', 0):.1f} | {errors} |")
    if "litellm" in got:
        lit = got["litellm"]
        l50, lrps = _med([r.p50_ms for r in lit]), _med([r.rps for r in lit])
        lcpu = per_request(cpu, "litellm").get("litellm", 0.0) * 1e6
        row += (f" {l50:.3f} | +{l50 - b50:.3f} | {lrps:,.0f} | {lcpu:.0f} "
                f"| {grps / max(lrps, 1e-9):.1f}x | {sum(r.non_2xx for r in lit)} |")
    return row


def _table(rows: list[str], args: argparse.Namespace) -> str:
    head = ("| body | conc. | bare p50 ms | gw p50 ms | added p50 | bare req/s | gw req/s | gw/bare "
            "| bare CPU us/req | gw CPU us/req (Envoy / ext_proc / store) | gw/bare CPU | bare wake-ups/req "
            "| gw wake-ups/req (Envoy / ext_proc / store) | non-2xx |")
    rule = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    if args.litellm:
        head += (" LiteLLM p50 ms | LiteLLM added p50 | LiteLLM req/s | LiteLLM CPU us/req | gw/LiteLLM req/s "
                 "| LiteLLM non-2xx |")
        rule += "---|---|---|---|---|---|"
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ext_proc workers: {args.workers}; "
            f"{args.rounds} alternating rounds, {args.duration:.0f}s per condition and level; medians of rounds"
            + (f"; LiteLLM: {LITELLM}, one worker" if args.litellm else "") + ".\n")
    return head + "\n" + rule + "\n" + "\n".join(rows) + "\n" + note
