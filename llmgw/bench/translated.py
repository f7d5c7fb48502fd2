"""`llmgw bench translated`: what translating to another API shape costs. One simulated engine serves
both APIs on one core (`enginesim --api anthropic`: OpenAI's chat completions and Anthropic's
Messages), one gateway in front of it with two routes to it - `chat-default` through the pool (the
OpenAI shape, no translation) and `chat-anthropic` through an Anthropic-shaped deployment (the
request translated by the decision, its answer - JSON or stream - by Envoy's Lua answer filter:
extproc/direct.py) - and the Anthropic front door (`/v1/messages`) to the pool (the Lua door
filter translates the answer and the stream for the client). A second engine of the same profile
speaks Bedrock's Converse (`chat-bedrock`: translated and SigV4 signed the same way, its AWS event
stream read back by the Lua filter too), a third Gemini's generateContent (`chat-gemini`: its JSON and
its SSE stream translated by the Lua filter). All budgeted, same request.

- JSON at concurrency 1, wrk in alternating rounds: p50 and the CPU per request of ext_proc and of
  Envoy (the Lua filter's work is Envoy's).
- Streams: the same streams on each route (one event per token); ext_proc's and Envoy's CPU per
  streamed chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from extproc.config import load_snapshot
from extproc.shapes.anthropic.door import MESSAGES_PATH
from llmgw.bench.kit import WRK_LUA, Result, demo_policy, measured_wrk, report, run_wrk
from llmgw.conformance.record import stamp
from llmgw.local.procs import Child, cpu_seconds, free_port, http_ok, python_module, wait_until
from llmgw.local.stack import Stack, StackOptions, gateway_processes

PROVIDER_MODEL = "claude-sim-1"
PROVIDER_PRICES = {"version": "2026-12-a", "currency": "USD", "input_per_mtok": 3000000,
                   "cached_input_per_mtok": 300000, "output_per_mtok": 15000000}


def simulated_provider(api: str, model: str, key: str, log: Path, time_scale: float = 0.02,
                       *extra: str) -> tuple[Child, str]:
    """A simulated engine speaking a provider's API shape (`enginesim --api anthropic|azure`) that
    accepts only `key`, started and answering; returns it and its URL."""
    port = free_port()
    child = Child(f"{api}-sim", python_module("enginesim", "--port", str(port), "--time-scale", str(time_scale),
                                              "--api", api, "--served-model-name", model, *extra),
                  log, env={"ENGINESIM_API_KEY": key}).start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_ok(f"{url}/health"), 30, "enginesim", child)
    return child, url


def add_anthropic_route(policy: Path, endpoint: str, key: str, route: str = "chat-anthropic",
                        mode: str = "reject") -> str:
    """A deployment of an Anthropic-shaped provider at `endpoint` (`claude-sim`, its key in
    `claude.key`), passing evidence from today, and a route of it alone. Returns the deployment's
    reference. (The benchmark and the tests build on it.)"""
    return add_provider_route(policy, "claude-sim", "anthropic@1", "anthropic-messages@2023-06-01", PROVIDER_MODEL,
                              endpoint, key, route, mode)


def add_provider_route(policy: Path, name: str, adapter: str, engine: str, model: str, endpoint: str, key: str,
                       route: str, mode: str = "reject", options: dict[str, str] | None = None) -> str:
    """A hosted deployment `name` at `endpoint` speaking `adapter` with its `options` (the pool
    deployment's copy with its own fingerprint, its key in `<name>.key`), passing evidence from today,
    and a route of it alone."""
    (policy / f"{name}.key").write_text(key)
    dep = yaml.safe_load((policy / "deployments/pool-llama-8b.yaml").read_text())
    dep.pop("pool")
    dep.update(deployment=name, served_model=model, endpoints=[endpoint],
               credential_ref=f"file:{name}.key", context_window=8192, prices=PROVIDER_PRICES)
    dep["fingerprint"].update(adapter=adapter, engine=engine,
                              model_digest="sha256:" + hashlib.sha256(name.encode()).hexdigest())
    if options:
        dep["fingerprint"]["adapter_options"] = options
    (policy / f"deployments/{name}.yaml").write_text(yaml.safe_dump(dep))
    ref: str = load_snapshot(policy).deployments[name].ref
    add_route_of(policy, route, ref, mode, adapter=adapter)
    stamp(policy, name, datetime.now(UTC).date())  # a benchmark's simulated candidate: its evidence is not measured
    return ref


def add_route_of(policy: Path, route: str, ref: str, mode: str = "reject", first: bool = True,
                 adapter: str = "anthropic@1") -> None:
    """A copy of chat-default named `route`, with the deployment `ref` as its only candidate (or, with
    first=False, after the pool's)."""
    base = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    cand = {**base["candidates"][0], "deployment_ref": ref, "adapter_ref": adapter}
    doc = {**base, "route_contract": route, "translation_loss": mode,
           "candidates": [cand] if first else [base["candidates"][0], cand]}
    (policy / f"routes/{route}.yaml").write_text(yaml.safe_dump(doc))


def _stream_chunks(url: str, key: str, model: str, tokens: int) -> int:
    """One stream of `tokens` tokens through `url` (a chat completion or, at /v1/messages, the
    Anthropic door): how many content chunks it carried."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
    body = json.dumps({"model": model, "max_tokens": tokens, "stream": True, "temperature": 0.5,
                       "messages": [{"role": "user", "content": "stream for the benchmark"}]})
    conn.request("POST", u.path, body, {"authorization": f"Bearer {key}", "content-type": "application/json"})
    data = conn.getresponse().read()
    conn.close()
    if u.path == MESSAGES_PATH:
        return data.count(b"event: content_block_delta")
    return data.count(b"data: ") - 1  # every chunk but [DONE]


def run_translated_bench(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-translated-"))
    provider_key = "sk-bench-provider"
    sim, sim_url = simulated_provider("anthropic", PROVIDER_MODEL, provider_key, work / "engine.log",
                                      args.time_scale)
    port = int(sim_url.rsplit(":", 1)[1])
    # A Bedrock-shaped provider of the same model on its own engine: SigV4 and the event stream.
    bedrock_key = "AKIDBENCHMARK0000001:bench-secret"
    bedrock, bedrock_url = simulated_provider("bedrock", PROVIDER_MODEL, bedrock_key, work / "bedrock.log",
                                              args.time_scale)
    gemini_key = "goog-bench-provider"
    gemini, gemini_url = simulated_provider("gemini", PROVIDER_MODEL, gemini_key, work / "gemini.log",
                                            args.time_scale)
    stack: Stack | None = None
    try:
        config, keys = demo_policy(Path(args.config).resolve(), work / "policy")
        # The pool's model is the provider's too: one engine answers both shapes.
        dep_path = config / "deployments/pool-llama-8b.yaml"
        dep = yaml.safe_load(dep_path.read_text())
        dep["served_model"] = PROVIDER_MODEL
        dep_path.write_text(yaml.safe_dump(dep))
        ref = load_snapshot(config).deployments["pool-llama-8b"].ref
        route_path = config / "routes/chat-default.yaml"
        route = yaml.safe_load(route_path.read_text())
        route["candidates"][0]["deployment_ref"] = ref
        route_path.write_text(yaml.safe_dump(route))
        stamp(config, "pool-llama-8b", datetime.now(UTC).date())
        add_anthropic_route(config, f"127.0.0.1:{port}", provider_key)
        add_provider_route(config, "bedrock-sim", "bedrock@1", "bedrock-converse@2023-09-30", PROVIDER_MODEL,
                           bedrock_url.removeprefix("http://"), bedrock_key, "chat-bedrock",
                           options={"region": "eu-central-1"})
        add_provider_route(config, "gemini-sim", "gemini@1", "gemini-api@v1beta", PROVIDER_MODEL,
                           gemini_url.removeprefix("http://"), gemini_key, "chat-gemini")
        snap = load_snapshot(config)
        opts = StackOptions.on_free_ports(config, work / "gw", snap, start_engines=False, envoy_concurrency=1,
                                          workers=1)
        opts.engine_ports = {p: (port,) for p in snap.gateway.pools}
        stack = Stack(opts).start()
        key = keys["acme"]
        chat_url, door_url = f"{stack.url}/v1/chat/completions", f"{stack.url}{MESSAGES_PATH}"
        routes = {"pool (OpenAI shape)": "chat-default", "anthropic (translated)": "chat-anthropic",
                  "bedrock (translated, signed; its own engine)": "chat-bedrock",
                  "gemini (translated; its own engine)": "chat-gemini",
                  "Anthropic door -> pool": "chat-default"}
        urls = {name: door_url if "door" in name else chat_url for name in routes}
        scripts = {}
        for name, model in routes.items():
            body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0.5,
                               "messages": [{"role": "user", "content": "hello from the benchmark"}]})
            scripts[name] = work / f"{model}.lua"
            scripts[name].write_text(WRK_LUA.format(body=body, key=key))
        json_rows: dict[str, list[Result]] = {n: [] for n in routes}
        json_cpu: dict[str, float] = dict.fromkeys(routes, 0.0)
        envoy_cpu: dict[str, float] = dict.fromkeys(routes, 0.0)
        served: dict[str, float] = dict.fromkeys(routes, 0.0)
        for name in routes:
            run_wrk(urls[name], scripts[name], 1, 2)  # warm-up
        for _ in range(args.rounds):
            for name in routes:
                r, spent, n = measured_wrk(urls[name], scripts[name], 1, args.duration / args.rounds,
                                           gateway_processes(stack))
                json_rows[name].append(r)
                json_cpu[name] += spent["ext_proc"]
                envoy_cpu[name] += spent["envoy"]
                served[name] += n
        stream_cpu: dict[str, float] = {}
        stream_envoy_cpu: dict[str, float] = {}
        chunks: dict[str, int] = {}
        for name, model in routes.items():
            _stream_chunks(urls[name], key, model, 4)  # warm-up
            before = cpu_seconds(gateway_processes(stack))
            got: list[int] = []

            def one(m: str = model, into: list[int] = got, u: str = urls[name]) -> None:
                into.append(_stream_chunks(u, key, m, args.tokens))
            threads = [threading.Thread(target=one) for _ in range(args.streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after = cpu_seconds(gateway_processes(stack))
            chunks[name] = sum(got)
            stream_cpu[name] = after["ext_proc"] - before["ext_proc"]
            stream_envoy_cpu[name] = after["envoy"] - before["envoy"]
    finally:
        if stack is not None:
            stack.stop()
        sim.stop()
        bedrock.stop()
        gemini.stop()
    base = statistics.median(r.p50_ms for r in json_rows["pool (OpenAI shape)"])
    lines = ["| route | p50 ms (c=1) | p50 over the pool | ext_proc CPU us/request | Envoy CPU us/request "
             "| streamed chunks | ext_proc CPU us/chunk | Envoy CPU us/chunk |", "|---|---|---|---|---|---|---|---|"]
    for name in routes:
        p50 = statistics.median(r.p50_ms for r in json_rows[name])
        per_request = max(served[name], 1) / 1e6
        lines.append(f"| {name} | {p50:.3f} | {p50 - base:+.3f} | {json_cpu[name] / per_request:.0f} "
                     f"| {envoy_cpu[name] / per_request:.0f} | {chunks[name]} "
                     f"| {stream_cpu[name] / max(chunks[name], 1) * 1e6:.1f} "
                     f"| {stream_envoy_cpu[name] / max(chunks[name], 1) * 1e6:.1f} |")
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; JSON: {args.rounds} alternating rounds of "
            f"{args.duration / args.rounds:.0f}s at concurrency 1; streams: {args.streams} at once of {args.tokens} "
            f"tokens per route; engine time scale {args.time_scale}; one ext_proc worker.\n")
    return report("\n".join(lines) + "\n" + note, args.output)


def register(bsub: Any) -> None:
    b = bsub.add_parser("translated", help="a route through an Anthropic-shaped provider against the pool")
    b.add_argument("--config", default="policy")
    b.add_argument("--duration", type=float, default=12.0)
    b.add_argument("--rounds", type=int, default=3)
    # Enough chunks that /proc's 10 ms CPU tick is a few us per chunk (8 streams: ~25 us).
    b.add_argument("--streams", type=int, default=64)
    b.add_argument("--tokens", type=int, default=128)
    b.add_argument("--time-scale", type=float, default=0.05)
    b.add_argument("--output")
    b.set_defaults(func=run_translated_bench)
