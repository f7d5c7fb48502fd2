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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format

from extproc.config import load_snapshot
from llmgw.demo_keys import ensure_demo_keys
from llmgw.envoy_render import duration_ms, pack, socket_address, static_cluster
from llmgw.procs import Child, envoy_binary, free_port, http_ok, wait_until
from llmgw.stack import Stack, StackOptions

COMPLETION = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}})
SSE = "".join(f"data: {json.dumps(c)}\n\n" for c in (
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": None}]},
    {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]},
)) + "data: [DONE]\n\n"


def _hcm(routes: list[route_components_pb2.Route]) -> listener_components_pb2.Filter:
    hcm = hcm_pb2.HttpConnectionManager(
        stat_prefix="bench", codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=route_pb2.RouteConfiguration(virtual_hosts=[route_components_pb2.VirtualHost(
            name="all", domains=["*"], routes=routes)]),
        http_filters=[hcm_pb2.HttpFilter(name="envoy.filters.http.router", typed_config=pack(router_pb2.Router()))])
    return listener_components_pb2.Filter(name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm))


def _direct(body: str, content_type: str, stream: bool | None) -> route_components_pb2.Route:
    match = route_components_pb2.RouteMatch(prefix="/")
    if stream is not None:
        match.headers.append(route_components_pb2.HeaderMatcher(name="x-bench-stream", present_match=stream))
    return route_components_pb2.Route(
        match=match, direct_response=route_components_pb2.DirectResponseAction(
            status=200, body=base_pb2.DataSource(inline_string=body)),
        response_headers_to_add=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="content-type", value=content_type))])


# A vLLM metrics page, so the gateway's endpoint picker scores the fake engine on every request.
METRICS = "".join(f'{name}{{engine="0",model_name="bench"}} {value}\n' for name, value in (
    ("vllm:num_requests_running", 0.0), ("vllm:num_requests_waiting", 0.0), ("vllm:kv_cache_usage_perc", 0.0)))


def upstream_bootstrap(port: int, admin: int) -> bootstrap_pb2.Bootstrap:
    """A fast fake engine: SSE when the client asked for a stream (marked by a header), else JSON;
    /metrics answers like vLLM's."""
    metrics = _direct(METRICS, "text/plain", None)
    metrics.match.ClearField("prefix")
    metrics.match.path = "/metrics"
    routes = [metrics, _direct(SSE, "text/event-stream", True), _direct(COMPLETION, "application/json", None)]
    return bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=socket_address("127.0.0.1", admin)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(listeners=[listener_pb2.Listener(
            name="up", address=socket_address("127.0.0.1", port),
            filter_chains=[listener_components_pb2.FilterChain(filters=[_hcm(routes)])])]))


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
                         "--log-level", "error"], workdir / f"{name}.log").start()
    wait_until(lambda: http_ok(f"http://127.0.0.1:{admin}/ready"), 30, name, child)
    return child


WRK_LUA = """
wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
{extra}
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


def demo_policy(src: Path, dst: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the policy to benchmark, with a demo key for each tenant that has none (llmgw up's)."""
    shutil.copytree(src, dst)
    keys, _ = ensure_demo_keys(dst, dst.parent / f"{dst.name}-keys")
    return dst, keys


def without_quotas(dst: Path) -> Path:
    doc = yaml.safe_load((dst / "gateway.yaml").read_text())
    doc["quotas"] = []
    (dst / "gateway.yaml").write_text(yaml.safe_dump(doc))
    return dst


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
        key = keys["acme"]
        body = json.dumps({"model": next(iter(snap.routes)), "max_tokens": 16,
                           "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
        for stream in (False, True):
            sbody = json.dumps({**json.loads(body), "stream": True}) if stream else body
            script = work / f"req-{stream}.lua"
            script.write_text(WRK_LUA.format(body=sbody, key=key,
                                             extra='wrk.headers["x-bench-stream"] = "1"' if stream else ""))
            for c in (int(x) for x in args.concurrency.split(",")):
                bare: list[Result] = []
                gw: list[Result] = []
                run_wrk(f"{stack.url}/v1/chat/completions", script, c, 2)  # warm-up
                for _ in range(args.rounds):
                    bare.append(run_wrk(f"http://127.0.0.1:{bare_port}/v1/chat/completions", script, c,
                                        args.duration / args.rounds))
                    gw.append(run_wrk(f"{stack.url}/v1/chat/completions", script, c, args.duration / args.rounds))
                rows.append(_row("stream" if stream else "json", c, bare, gw))
                print(rows[-1], flush=True)
        picked = _picked_share(stack.logs / "envoy.log", f"127.0.0.1:{up_port}")
    finally:
        stack.stop()
        for ch in children:
            ch.stop()
    table = _table(rows, args) + f"Endpoint picker named the engine on {picked:.0%} of the gateway's requests.\n"
    print(table)
    if args.output:
        Path(args.output).write_text(table)
    return 0


def _picked_share(envoy_log: Path, engine: str) -> float:
    """Share of access-log lines in which the picker's order named the engine (it scored it)."""
    lines = [json.loads(ln) for ln in envoy_log.read_text().splitlines() if ln.startswith("{")]
    return sum(1 for ln in lines if ln.get("picked") == engine) / max(1, len(lines))


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _row(kind: str, c: int, bare: list[Result], gw: list[Result]) -> str:
    b50, g50 = _med([r.p50_ms for r in bare]), _med([r.p50_ms for r in gw])
    b99, g99 = _med([r.p99_ms for r in bare]), _med([r.p99_ms for r in gw])
    brps, grps = _med([r.rps for r in bare]), _med([r.rps for r in gw])
    errors = sum(r.non_2xx for r in bare + gw)
    return (f"| {kind} | {c} | {b50:.3f} | {g50:.3f} | +{g50 - b50:.3f} | {b99:.3f} | {g99:.3f} | +{g99 - b99:.3f} "
            f"| {brps:,.0f} | {grps:,.0f} | {grps / brps:.1%} | {errors} |")


def _table(rows: list[str], args: argparse.Namespace) -> str:
    head = ("| body | conc. | bare p50 ms | gw p50 ms | added p50 | bare p99 ms | gw p99 ms | added p99 "
            "| bare req/s | gw req/s | gw/bare | non-2xx |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ext_proc workers: {args.workers}; "
            f"{args.rounds} alternating rounds, {args.duration:.0f}s per condition and level; medians of rounds.\n")
    return head + "\n".join(rows) + "\n" + note
