"""Gateway-against-gateway benchmarks: one run, one upstream (an Envoy answering like an engine),
bare Envoy and gateway variants measured in alternating rounds with the same wrk load.

`llmgw bench fallback`: `one-candidate` against `two-candidates` (the same route with a second,
qualified candidate: the composite cluster and the attempt filter on every request), budgets on.

`llmgw bench budget`: `budgets-off` (no reservation, no meter filter) against `budgets-on` (the
reservation script before dispatch, the meter settling off the response path, Valkey).

`llmgw bench policy`: what identity + authorization (Rego) + redaction add over the served path
(budgets off in all):
  bare     Envoy alone (the reference every ratio in BENCHMARKS.md is about)
  served   the gateway with an allow-all Rego policy and no obligations: the served-path pipeline
  full     the example policy (tenant, class, tools, residency; redaction obligations at `internal`)
           on a prompt carrying an e-mail, a card number and an IP address, with a tool
  full-nc  the same with the decision cache off: Rego evaluated on every request
  full-store `full` with Valkey beside it (budgets still off): the reference for full-dry
  full-dry `full-store` with a dry run of an allow-all candidate on every request: a second
           evaluation, a difference (obligations) on each, logged to the decision log in batches
Plus in-process figures: one Rego evaluation, and redaction of a 32 KiB prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from extproc.chat import map_rendered
from extproc.config import load_snapshot
from extproc.redact import Redactor
from llmgw.bench.kit import (
    WRK_LUA,
    Result,
    bare_bootstrap,
    demo_policy,
    report,
    run_wrk,
    start_envoy,
    upstream_bootstrap,
    wrk_missing,
)
from llmgw.conformance.record import stamp
from llmgw.local.procs import cpu_seconds, free_port
from llmgw.local.stack import Stack, StackOptions, gateway_processes

ALLOW_ALL = ('package llmgw.authz\n\nimport rego.v1\n\n'
             'decision := {"allow": true, "reasons": [], "obligations": {"redact": [], "record_content": false}}\n')
PROMPT = ("Please summarise the ticket from jane.doe@example.com about card 4111 1111 1111 1111 "
          "seen from 10.20.30.40, and suggest a reply.")


def _micro(config: Path) -> dict[str, float]:
    snap = load_snapshot(config)
    assert snap.policy is not None
    doc = {"identity": {"tenant": "acme", "subject": "k", "kind": "api_key", "groups": [], "effects": []},
           "request": {"route": "chat-default", "request_class": "read_only_chat", "data_class": "internal",
                       "model": "chat-default", "tools": [{"name": "search_docs", "known": True, "effects": []}],
                       "stream": False, "max_tokens": 16, "idempotency_key": False},
           "route": {"name": "chat-default", "request_class": "read_only_chat", "record_content": False},
           "candidates": [{"deployment": "pool-llama-8b", "data_classes": ["internal"], "regions": ["eu"]}]}
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        snap.policy.evaluate(doc)
    rego_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        snap.policy.decide(doc)
    cached_us = (time.perf_counter() - t0) / n * 1e6
    rng = random.Random(0)
    words = ["the", "gateway", "routes", "each", "tenant", "request", "to", "a", "qualified",
             "deployment", "über", "数据", "данные"]
    parts: list[str] = []
    while sum(len(w) + 1 for w in parts) < 32 * 1024:
        parts.append(rng.choice(words) if rng.random() > 0.01 else rng.choice(
            ["a.b@example.com", "4111 1111 1111 1111", "+44 20 7946 0958", "10.0.0.1", "123-45-6789"]))
    body = {"messages": [{"role": "user", "content": " ".join(parts)}]}
    entities = frozenset(snap.policy_data["redaction"]["entities"])
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        redactor = Redactor(entities)
        map_rendered(body, redactor.redact, lambda name, _: name)
        times.append(time.perf_counter() - t0)
    return {"rego_eval_us": rego_us, "rego_cached_us": cached_us,
            "redact_32k_p50_ms": statistics.median(times) * 1e3,
            "redact_32k_p99_ms": sorted(times)[int(len(times) * 0.99)] * 1e3}


@dataclass(frozen=True)
class Variant:
    config: Path
    extproc_args: tuple[str, ...] = ()
    with_valkey: bool = False


CpuUs = dict[tuple[str, int], dict[str, float]]  # (variant, concurrency) -> process -> CPU us per request


def _cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time (user + system) each of the gateway's processes has used so far."""
    return cpu_seconds(gateway_processes(stack))


def compare(variants: dict[str, Variant], body: str, key: str, args: argparse.Namespace,
            baseline: str) -> tuple[dict[tuple[str, int], list[Result]], CpuUs]:
    """Bare Envoy and each gateway variant, one upstream, wrk in alternating rounds; and the CPU each
    variant's processes spent per request (Linux /proc), so a ratio can be traced to a process."""
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    up_port, up_admin, bare_port, bare_admin = (free_port() for _ in range(4))
    children = [start_envoy("upstream", upstream_bootstrap(up_port, up_admin), work, up_admin),
                start_envoy("bare", bare_bootstrap(bare_port, bare_admin, up_port), work, bare_admin)]
    stacks: dict[str, Stack] = {}
    script = work / "req.lua"
    script.write_text(WRK_LUA.format(body=body, key=key))
    urls = {"bare": f"http://127.0.0.1:{bare_port}/v1/chat/completions"}
    results: dict[tuple[str, int], list[Result]] = {}
    cpu_s: dict[tuple[str, int], dict[str, float]] = {}
    done: dict[tuple[str, int], float] = {}  # requests served, for CPU per request
    secs = max(1, round(args.duration / args.rounds))  # what run_wrk runs for
    try:
        for name, v in variants.items():
            snap = load_snapshot(v.config)
            opts = StackOptions.on_free_ports(v.config, work / name, snap, with_valkey=v.with_valkey,
                                              start_engines=False, envoy_concurrency=1, extproc_args=v.extproc_args,
                                              workers=args.workers)
            opts.engine_ports = {p: (up_port,) for p in snap.gateway.pools}
            stacks[name] = Stack(opts).start()
            urls[name] = f"{stacks[name].url}/v1/chat/completions"
        for c in (int(x) for x in args.concurrency.split(",")):
            for url in urls.values():
                run_wrk(url, script, c, 2)  # warm-up
            for _ in range(args.rounds):
                for name, url in urls.items():
                    before = _cpu_seconds(stacks[name]) if name in stacks else {}
                    r = run_wrk(url, script, c, args.duration / args.rounds)
                    results.setdefault((name, c), []).append(r)
                    if name in stacks:
                        spent = cpu_s.setdefault((name, c), {})
                        for proc, sec in _cpu_seconds(stacks[name]).items():
                            spent[proc] = spent.get(proc, 0.0) + sec - before.get(proc, 0.0)
                        done[(name, c)] = done.get((name, c), 0.0) + r.rps * secs
    finally:
        for s in stacks.values():
            s.stop()
        for ch in children:
            ch.stop()
    cpu = {k: {proc: sec / done[k] * 1e6 for proc, sec in v.items()} for k, v in cpu_s.items() if done.get(k)}
    return results, cpu


def run_policy_bench(args: argparse.Namespace) -> int:
    if wrk_missing():
        return 2
    config = Path(args.config).resolve()
    micro = _micro(config)
    print(json.dumps(micro), flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="llmgw-bench-policy-"))
    config, keys = demo_policy(config, scratch / "base")
    # Budgets off in all three: this benchmark isolates identity, Rego and redaction.
    served = _variant_policy(config, scratch / "served", allow_all=True)
    full = _variant_policy(config, scratch / "full")
    body = json.dumps({"model": "chat-default", "max_tokens": 16, "messages": [{"role": "user", "content": PROMPT}],
                       "tools": [{"type": "function", "function": {"name": "search_docs"}}]})
    dry = _variant_policy(config, scratch / "full-dry", dry_run=True)
    variants = {"served": Variant(served), "full": Variant(full), "full-nc": Variant(full, ("--no-decision-cache",)),
                "full-store": Variant(full, with_valkey=True), "full-dry": Variant(dry, with_valkey=True)}
    results, cpu = compare(variants, body, keys["acme"], args, "served")
    return report(_table(results, args, "served") + _cpu_table(cpu) + _micro_note(micro), args.output)


def _variant_policy(src: Path, dst: Path, allow_all: bool = False, budgets: bool = False,
                    dry_run: bool = False) -> Path:
    """A copy of the policy with budgets on or off, and optionally an allow-all Rego policy or a dry
    run of one beside the policy."""
    shutil.copytree(src, dst)
    if dry_run:
        (dst / "candidate").mkdir()
        (dst / "candidate" / "authz.rego").write_text(ALLOW_ALL)
        gw = yaml.safe_load((dst / "gateway.yaml").read_text())
        gw["policy_dry_run"] = {"directory": "candidate"}
        (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    if allow_all:
        for p in dst.rglob("*.rego"):
            p.unlink()
        (dst / "allow_all.rego").write_text(ALLOW_ALL)
    for p in (dst / "routes").glob("*.yaml"):
        doc = yaml.safe_load(p.read_text())
        doc["budget_reservation"] = "required" if budgets else "off"
        p.write_text(yaml.safe_dump(doc))
    return dst


def _micro_note(micro: dict[str, Any]) -> str:
    return (f"In process: one Rego evaluation {micro['rego_eval_us']:.0f} us (decision cache hit "
            f"{micro['rego_cached_us']:.0f} us); redaction of a 32 KiB prompt p50 {micro['redact_32k_p50_ms']:.2f} ms, "
            f"p99 {micro['redact_32k_p99_ms']:.2f} ms.\n")


def run_budget_bench(args: argparse.Namespace) -> int:
    """Reservation (one Lua script before dispatch) + settlement (the meter filter, off the response
    path) over the same gateway without budgets."""
    if wrk_missing():
        return 2
    config = Path(args.config).resolve()
    scratch = Path(tempfile.mkdtemp(prefix="llmgw-bench-budget-"))
    config, keys = demo_policy(config, scratch / "base")
    off = _variant_policy(config, scratch / "off")
    on = _variant_policy(config, scratch / "on", budgets=True)
    body = json.dumps({"model": "chat-default", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
    results, cpu = compare({"budgets-off": Variant(off), "budgets-on": Variant(on, with_valkey=True)}, body,
                           keys["acme"], args, "budgets-off")
    return report(_table(results, args, "budgets-off") + _cpu_table(cpu), args.output)


def add_candidate(policy: Path, deployment: str, pool: str, endpoint: str, fingerprint: dict[str, str],
                  candidate: dict[str, Any] | None = None, route_name: str = "", **fields: Any) -> str:
    """Give the policy's route `route_name` (by default its only one: a policy of several must name it,
    never the first a directory listing gives, whose order differs between file systems) another
    candidate: a copy of its first candidate's deployment,
    named `deployment`, on a pool of its own at `endpoint`, its fingerprint and fields changed as given,
    with passing evidence from today, appended to the route's candidates with `candidate`'s changes.
    Returns the new deployment's reference. (Benchmarks and tests build their variants with it.)"""
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["pools"][pool] = {"endpoints": [endpoint]}
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    if route_name:
        route_path = policy / "routes" / f"{route_name}.yaml"
    else:
        (route_path,) = (policy / "routes").glob("*.yaml")  # (a policy of several routes names one)
    route = yaml.safe_load(route_path.read_text())
    first = route["candidates"][0]
    dep = yaml.safe_load((policy / "deployments" / f"{first['deployment_ref'].split('@')[0]}.yaml").read_text())
    dep.pop("credential_ref", None)  # a credential belongs to one deployment only
    dep.update(deployment=deployment, pool=pool, **fields)
    dep["fingerprint"].update(fingerprint)
    (policy / "deployments" / f"{deployment}.yaml").write_text(yaml.safe_dump(dep))
    ref: str = load_snapshot(policy).deployments[deployment].ref
    route["candidates"].append({**first, "deployment_ref": ref, **(candidate or {})})
    route_path.write_text(yaml.safe_dump(route))
    stamp(policy, deployment, datetime.now(UTC).date())  # a benchmark's candidate: its evidence is not measured
    return ref


def _with_second_candidate(dst: Path) -> Path:
    """The policy's route with a second candidate: the same model on a pool of its own (a provider
    failover), so every request's plan has two candidates. The benchmark points the pool at its upstream."""
    add_candidate(dst, "backup", "backup-pool", "127.0.0.1:9", {"hardware": "backup-pool-hardware"})
    return dst


def run_fallback_bench(args: argparse.Namespace) -> int:
    """What being ready to fall back costs a healthy request: a route of two candidates (the composite
    cluster and the attempt filter on every request) against the same route with one."""
    if wrk_missing():
        return 2
    config = Path(args.config).resolve()
    scratch = Path(tempfile.mkdtemp(prefix="llmgw-bench-fallback-"))
    config, keys = demo_policy(config, scratch / "base")
    one = _variant_policy(config, scratch / "one", budgets=True)
    two = _with_second_candidate(_variant_policy(config, scratch / "two", budgets=True))
    body = json.dumps({"model": "chat-default", "max_tokens": 16,
                       "messages": [{"role": "user", "content": "How many tokens does this prompt take?"}]})
    results, cpu = compare({"one-candidate": Variant(one, with_valkey=True),
                            "two-candidates": Variant(two, with_valkey=True)}, body, keys["acme"], args,
                           "one-candidate")
    return report(_table(results, args, "one-candidate") + _cpu_table(cpu), args.output)


def _cpu_table(cpu: CpuUs) -> str:
    procs = ("envoy", "ext_proc", "store")
    rows = ["\n| proxy | conc. | " + " | ".join(f"{p} CPU us/req" for p in procs) + " | total |",
            "|---|---|" + "---|" * (len(procs) + 1)]
    for (name, c), per in cpu.items():
        rows.append(f"| {name} | {c} | " + " | ".join(f"{per[p]:.0f}" if p in per else "-" for p in procs)
                    + f" | {sum(per.values()):.0f} |")
    return "\n".join(rows) + "\n"


def _table(results: dict[tuple[str, int], list[Result]], args: argparse.Namespace, baseline: str) -> str:
    rows = [f"| proxy | conc. | p50 ms | p99 ms | req/s | p50 over {baseline} | req/s vs {baseline} | non-2xx |",
            "|---|---|---|---|---|---|---|---|"]
    for (name, c), rs in results.items():
        p50, p99, rps = (statistics.median([getattr(r, f) for r in rs]) for f in ("p50_ms", "p99_ms", "rps"))
        srv = results[(baseline, c)]
        s50, srps = statistics.median([r.p50_ms for r in srv]), statistics.median([r.rps for r in srv])
        rows.append(f"| {name} | {c} | {p50:.3f} | {p99:.3f} | {rps:,.0f} | {p50 - s50:+.3f} | {rps / srps:.2f} "
                    f"| {sum(r.non_2xx for r in rs)} |")
    note = (f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} alternating rounds, "
            f"{args.duration:.0f}s per proxy and level; ext_proc workers: {args.workers}; medians of rounds.\n")
    return "\n".join(rows) + "\n" + note


def register(bsub: Any) -> None:
    for name, func, helptext in (
            ("policy", run_policy_bench, "identity + Rego + redaction over the served path, one run"),
            ("budget", run_budget_bench, "reservation + settlement over the same gateway without budgets"),
            ("fallback", run_fallback_bench, "a route of two candidates against the same route with one")):
        b = bsub.add_parser(name, help=helptext)
        b.add_argument("--config", default="policy")
        b.add_argument("--duration", type=float, default=9.0)
        b.add_argument("--concurrency", default="1,32")
        b.add_argument("--rounds", type=int, default=3)
        b.add_argument("--workers", type=int, default=1, help="ext_proc worker processes in every variant")
        b.add_argument("--output")
        b.set_defaults(func=func)
