"""The whole gateway on one machine: embedded Valkey, engines, ext_proc workers and Envoy.

`llmgw up` runs one Stack until it is told to stop; the end-to-end tests run the same Stack on free
ports, so what the tests prove is what a user starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from envoy.config.bootstrap.v3 import bootstrap_pb2

from extproc.config import Snapshot, earned, load_snapshot
from extproc.config.schema import Deployment
from extproc.contract import WORKER_HEALTH_PATH
from extproc.corpora import quality_corpus
from extproc.secrets import env_name, resolve
from extproc.shapes.registry import shape_of
from llmgw.local import vllm_env
from llmgw.local.demo_keys import ensure_demo_keys, refuse_exposed
from llmgw.local.procs import (
    Child,
    PortInUse,
    answers,
    envoy_binary,
    envoy_env,
    free_port,
    http_ok,
    json_at,
    port_free,
    python_module,
    tcp_open,
    valkey_binary,
    wait_until,
)
from llmgw.local.tls import demo_certs
from llmgw.ops.gateway_state import ADMIN_TOKEN, LOOPS_STATE, ensure_admin_token, ensure_own_secrets, kept_key
from llmgw.render.bootstrap import RenderOptions, render_bootstrap, simulated_providers
from llmgw.render.common import UNIX, hp


def provider_api(dep: Deployment) -> str:
    """The simulator's `--api` for a hosted deployment: its shape's front end (Azure's path for an
    OpenAI-shaped deployment of kind azure), from the shapes registry."""
    return shape_of(dep.fingerprint.adapter).simulator_api(dep.fingerprint.adapter_options)


class DemoKeysExposed(OSError):
    """The listener would accept demo keys from beyond this machine."""


# (served model name, host, port) -> (argv, extra environment) of one engine process
# (served model, what it serves, host, port) -> (argv, env)
EngineLauncher = Callable[[str, str, str, int], tuple[list[str], dict[str, str]]]
# A launched child's readiness: the check, what it is, the child, and the least seconds to allow it
Ready = tuple[Callable[[], bool], str, Child, float]



@dataclass
class StackOptions:
    config_dir: Path
    state_dir: Path
    listen_port: int | None = None  # None: gateway.yaml's envoy.listen
    admin_port: int | None = None
    extproc_ports: tuple[int, ...] | None = None
    workers: int = 1
    engine_ports: dict[str, tuple[int, ...]] | None = None  # per pool; None: gateway.yaml's endpoints
    engine_profile: str = "llama-3-8b@h100"
    engine_args: tuple[str, ...] = ()
    time_scale: float = 1.0
    valkey_port: int | None = None
    with_valkey: bool = True
    start_engines: bool = True  # False: the pools' endpoints are already served (benchmarks)
    engine: str = "sim"  # "sim": enginesim; "vllm": real vLLM (CPU build) serving a generated tiny model
    vllm_venv: Path | None = None  # default: .venv-vllm beside the project
    engine_timeout: float = 60.0  # vLLM takes ~45-60 s to be ready on 2 cores
    envoy_concurrency: int | None = None
    extproc_args: tuple[str, ...] = ()
    pool_lb: str = "picker"  # or "round_robin" (a benchmark baseline: no picker)
    tls: bool = False  # demo certificates: TLS for clients, mTLS between Envoy and ext_proc
    require_client_certificate: bool = False
    status_ports: tuple[int, ...] | None = None  # ext_proc status endpoints; None: free ports
    demo_keys: bool = False  # make a demo key for each tenant without one (llmgw/local/demo_keys.py)
    # Run a simulated provider for each hosted deployment on loopback (llmgw up; the conformance sandbox).
    simulate_providers: bool = False
    provider_ports: dict[str, tuple[int, ...]] | None = None  # per deployment; None: its own endpoints
    traces: bool = False  # the workers' spans into <state>/traces.jsonl (llmgw up)
    extproc_env: dict[str, str] = field(default_factory=dict)  # more environment for the workers (OTLP)
    # Where the workers read the evidence earned at run time besides the policy's own
    # (extproc/config/earned.py); None: <state_dir>/evidence. Never the environment's: a sandbox started
    # inside `llmgw up` reads its own, not the gateway's that started it.
    evidence_dir: Path | None = None
    region: str = ""  # where this gateway runs (ext_proc --region); "" = not declared
    # The simulators' answer quality, an operator's setting (enginesim/oracle.py): right on this share
    # of the tasks of the policy's quality corpora. None: none right (seeded words, as ever).
    sim_quality: float | None = None
    # Benchmarks only (`llmgw bench ablate`): the module the workers run (one that wraps extproc's
    # with decision stages left out), and an edit of the rendered bootstrap (a filter taken out).
    extproc_module: str = "extproc"
    bootstrap_edit: Callable[[bootstrap_pb2.Bootstrap], None] | None = None

    @classmethod
    def on_free_ports(cls, config_dir: Path, state_dir: Path, snap: Snapshot, **kw: object) -> StackOptions:
        workers = int(kw.pop("workers", 1))  # type: ignore[call-overload]
        if kw.get("simulate_providers"):
            kw["provider_ports"] = {d.deployment: tuple(free_port() for _ in d.endpoints)
                                    for d in simulated_providers(snap)}
        return cls(config_dir=config_dir, state_dir=state_dir, listen_port=free_port(), admin_port=free_port(),
                   extproc_ports=tuple(free_port() for _ in range(workers)), workers=workers,
                   engine_ports={p: tuple(free_port() for _ in pool.endpoints)
                                 for p, pool in snap.gateway.pools.items()},
                   valkey_port=free_port(), **kw)  # type: ignore[arg-type]


# Valkey's append-only file, fsynced every second (its default). `always` (every acknowledged write
# on disk before its reply) closes the last gap - a Valkey crash can lose the second of reservations
# and ledger entries before it (seen once in tests/e2e/operations/test_supervisor.py) - but puts the disk's fsync
# latency on every request's reservation: right after a large install it stalled Valkey past the
# store timeout and requests failed closed (503) in the real-vLLM lane. See docs/guide/operations.md.
VALKEY_DURABILITY = ("--appendonly", "yes", "--appendfsync", "everysec")


@dataclass
class Stack:
    opts: StackOptions
    snapshot: Snapshot = field(init=False)
    envoy: Child | None = None
    valkey: Child | None = None
    engines: dict[str, Child] = field(default_factory=dict)  # "host:port" -> child
    extprocs: list[Child] = field(default_factory=list)
    render: RenderOptions = field(init=False)

    def __post_init__(self) -> None:
        self.opts.state_dir = self.opts.state_dir.resolve()
        self._demo_keys, self.new_demo_keys = (ensure_demo_keys(self.opts.config_dir, self.opts.state_dir)
                                               if self.opts.demo_keys else ({}, []))
        self.snapshot = load_snapshot(self.opts.config_dir, earned=self.evidence_dir)
        o, env = self.opts, self.snapshot.gateway.envoy
        listen_host = env.listen.rsplit(":", 1)[0]
        overrides: dict[str, object] = {}
        if o.listen_port:
            overrides["listen"] = (listen_host, o.listen_port)
        if o.admin_port:
            overrides["admin"] = ("127.0.0.1", o.admin_port)
        extproc = tuple(hp(e) for e in env.extproc)
        if o.extproc_ports:
            extproc = tuple(("127.0.0.1", p) for p in o.extproc_ports)
        elif o.workers > 1:
            base = extproc[0][1]
            extproc = tuple(("127.0.0.1", base + i) for i in range(o.workers))
        if not o.tls:
            # Envoy reaches its workers on Unix sockets in an owner-only directory: no other local user
            # or process of another user can send them decisions' questions or settlement records. (With
            # TLS the workers listen on TCP and admit only Envoy's client certificate.) Each keeps its
            # number to name it.
            extproc = tuple((f"{UNIX}{socket_path(o.state_dir, f'extproc-{port}.sock')}", port) for _, port in extproc)
        overrides["extproc"] = extproc
        if o.engine_ports:
            overrides["pools"] = {p: tuple(("127.0.0.1", port) for port in ports)
                                  for p, ports in o.engine_ports.items()}
        if o.simulate_providers:
            overrides["providers"] = {d.deployment: tuple(("127.0.0.1", port) for port in (
                (o.provider_ports or {}).get(d.deployment) or [hp(e)[1] for e in d.endpoints]))
                for d in simulated_providers(self.snapshot)}
        overrides["pool_lb"] = o.pool_lb
        overrides["admin_socket"] = str(socket_path(o.state_dir, "envoy-admin.sock"))
        if o.tls:
            overrides["tls"] = demo_certs(o.state_dir / "tls", o.require_client_certificate)
        self.render = RenderOptions.from_snapshot(self.snapshot, **overrides)
        self.status_ports = o.status_ports or tuple(free_port() for _ in self.render.extproc)
        # Envoy's health check of each worker goes to its status server (render/clusters.py).
        self.render = replace(self.render, extproc_status=self.status_ports)

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self.render.listen
        return f"{'https' if self.render.tls.listener else 'http'}://{host}:{port}"

    @property
    def traces_file(self) -> Path:
        return self.opts.state_dir / "traces.jsonl"

    @property
    def metrics_url(self) -> str:
        """Prometheus text for every ext_proc worker (any worker's status port answers for all)."""
        return f"http://127.0.0.1:{self.status_ports[0]}/metrics"

    @property
    def status_urls(self) -> list[str]:
        """Each ext_proc worker's GET /status: serving revision and the last reload's outcome."""
        return [f"http://127.0.0.1:{p}/status" for p in self.status_ports]

    @property
    def admin_url(self) -> str:
        host, port = self.render.admin
        return f"http://{host}:{port}"

    def engine_urls(self, pool: str | None = None) -> list[str]:
        pools = [pool] if pool else list(self.render.pools)
        return [f"http://{h}:{p}" for name in pools for h, p in self.render.pools[name]]

    @property
    def logs(self) -> Path:
        return self.opts.state_dir / "logs"

    def demo_keys(self) -> dict[str, str]:
        """tenant -> the demo key `llmgw up` made for it (none unless StackOptions.demo_keys)."""
        return dict(self._demo_keys)

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def own_store(self) -> bool:
        """Whether this stack starts a Valkey of its own: not when gateway.yaml names the store."""
        return self.opts.with_valkey and not self.snapshot.gateway.store.url

    def children(self) -> list[Child]:
        return [c for c in (self.envoy, *self.extprocs, *self.engines.values(), self.valkey) if c is not None]

    def ports_to_bind(self) -> list[tuple[str, int, str]]:
        """(host, port, what sets it) of every port this stack's processes will listen on."""
        ports = [(*self.render.listen, "--port (or gateway.yaml envoy.listen)"),
                 (*self.render.admin, "--admin-port (or gateway.yaml envoy.admin)")]
        ports += [(h, p, "gateway.yaml envoy.extproc") for h, p in self.render.extproc if not h.startswith(UNIX)]
        if self.own_store:
            ports.append(("127.0.0.1", self.opts.valkey_port or 6379, "--valkey-port"))
        if self.opts.start_engines:
            ports += [(h, p, f"gateway.yaml pools.{name}.endpoints")
                      for name, hosts in self.render.pools.items() for h, p in hosts]
        ports += [(h, p, f"deployments/{name}.yaml endpoints") for name, hosts in self.render.providers.items()
                  for h, p in hosts]
        return ports

    def start(self, timeout: float = 60.0) -> Stack:
        self.opts.state_dir.mkdir(parents=True, exist_ok=True)
        refusal = refuse_exposed(self.snapshot, self.render.listen[0])
        if refusal:
            raise DemoKeysExposed(refusal)
        for host, port, option in self.ports_to_bind():
            if not port_free(host, port):
                raise PortInUse(f"port {port} on {host} is in use; choose another with {option}")
        try:
            # Every child is launched first and waited for after: they boot side by side (ext_proc's
            # imports, the engines', Valkey's), while this process renders Envoy's configuration.
            # ext_proc reaches its store and engines when a request needs them, not at start.
            ready: list[Ready] = []
            if self.own_store:
                ready += self._start_valkey()
            if self.opts.start_engines:
                ready += self._start_engines()
            ready += self._start_providers()
            ready += self._start_extprocs()
            # As binary protobuf, which Envoy reads by its .pb name: writing it as YAML took a second
            # of this process's time per boot (`llmgw envoy render` writes the same bootstrap as YAML).
            boot = render_bootstrap(self.snapshot, self.render)
            if self.opts.bootstrap_edit is not None:
                self.opts.bootstrap_edit(boot)
            config = boot.SerializeToString()
            for check, what, child, wait in ready:
                wait_until(check, max(timeout, wait), what, child)
            self._start_envoy(config, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_valkey(self) -> list[Ready]:
        port = self.opts.valkey_port or 6379
        data = self.opts.state_dir / "valkey"
        data.mkdir(parents=True, exist_ok=True)
        self.valkey = Child("valkey", [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1",
                                       "--dir", str(data), *VALKEY_DURABILITY, "--save", "",
                                       "--protected-mode", "yes"], self.logs / "valkey.log").start()
        return [(partial(tcp_open, "127.0.0.1", port), "valkey", self.valkey, 0.0)]

    def _pool_deployment(self, pool: str) -> Deployment | None:
        return next((d for d in self.snapshot.deployments.values() if d.pool == pool), None)

    def _engine_of(self, pool: str) -> tuple[str, str]:
        """The model a pool's engines serve, and what they serve (chat, or embeddings as a pooling runner)."""
        dep = self._pool_deployment(pool)
        return (dep.served_model, dep.serves) if dep else ("unused", "chat")

    def _start_engines(self) -> list[Ready]:
        launch = self._vllm_launcher() if self.opts.engine == "vllm" else self._sim_launcher()
        for pool, hosts in self.render.pools.items():
            for host, port in hosts:
                argv, env = launch(*self._engine_of(pool), host, port)
                self.engines[f"{host}:{port}"] = Child(f"engine-{port}", argv, self.logs / f"engine-{port}.log",
                                                       env=env).start()
        return [(partial(http_ok, f"http://{addr}/health"), f"engine {addr}", child, self.opts.engine_timeout)
                for addr, child in self.engines.items()]

    def _start_providers(self) -> list[Ready]:
        """A simulated provider of each hosted deployment's API shape, on the address it is rendered
        with, taking the key its credential reference resolves to (made here when unset)."""
        env = self._extproc_env()
        for name, hosts in self.render.providers.items():
            dep = self.snapshot.deployments[name]
            key = env.get(dep.credential_ref.partition(":")[2], "") if dep.credential_ref else ""
            if dep.credential_ref and not key:
                key = resolve(dep.credential_ref, self.snapshot.directory)
            for host, port in hosts:
                argv = python_module("enginesim", "--api", provider_api(dep), "--host", host, "--port", str(port),
                                     "--served-model-name", dep.served_model, "--profile", self.opts.engine_profile,
                                     "--time-scale", str(self.opts.time_scale),
                                     "--max-model-len", str(dep.context_window), *self._oracle_args())
                self.engines[f"{host}:{port}"] = Child(f"provider-{name}-{port}", argv,
                                                       self.logs / f"provider-{name}-{port}.log",
                                                       env={"ENGINESIM_API_KEY": key} if key else {}).start()
        return [(partial(http_ok, f"http://{host}:{port}/health"), f"provider {name}", self.engines[f"{host}:{port}"],
                 0.0) for name, hosts in self.render.providers.items() for host, port in hosts]

    def _sim_launcher(self) -> EngineLauncher:
        windows = {d.served_model: d.context_window for d in self.snapshot.deployments.values()}

        def launch(served: str, serves: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
            # The engine's window is the deployment's, so gateway and engine agree on what fits.
            runner = ["--runner", "pooling"] if serves == "embeddings" else []
            return python_module("enginesim", "--host", host, "--port", str(port), "--served-model-name", served,
                                 "--profile", self.opts.engine_profile, "--time-scale", str(self.opts.time_scale),
                                 "--max-model-len", str(windows.get(served, 8192)), *runner,
                                 *(() if runner else self._oracle_args()), *self.opts.engine_args
                                 ), dict(vllm_env.DEV_MODE)
        return launch

    def _oracle_args(self) -> list[str]:
        """A simulator's answer quality (StackOptions.sim_quality) on the policy's quality corpora."""
        if self.opts.sim_quality is None:
            return []
        corpora = sorted({str(quality_corpus(rc.quality.corpus, self.snapshot.directory))
                          for rc in self.snapshot.gateway.request_classes.values() if rc.quality is not None})
        return [*(a for c in corpora for a in ("--quality-oracle", c)),
                "--quality-accuracy", str(self.opts.sim_quality)]

    def _vllm_launcher(self) -> EngineLauncher:
        python = vllm_env.ensure_venv(self.opts.vllm_venv or vllm_env.default_venv(), self.logs / "vllm-install.log")
        model = vllm_env.ensure_tiny_model(python, self.opts.state_dir / "tiny-model", self.logs / "tiny-model.log")

        def launch(served: str, serves: str, host: str, port: int) -> tuple[list[str], dict[str, str]]:
            return vllm_env.server_argv(python, model, served, host, port, serves=serves), vllm_env.offline_env()
        return launch

    def _extproc_env(self) -> dict[str, str]:
        """The gateway's own secrets and the simulated providers' keys the environment does not set,
        kept in the state directory (llmgw/ops/gateway_state.py)."""
        state = self.opts.state_dir
        env = {name: path.read_text().strip() for name, path in ensure_own_secrets(self.snapshot, state).items()}
        # A simulated provider's key: the provider and ext_proc must agree on it.
        for name in self.render.providers:
            var = env_name(self.snapshot.deployments[name].credential_ref)
            if var and not os.environ.get(var):
                api = provider_api(self.snapshot.deployments[name])
                env[var] = kept_key(state / f"provider-{name}.key", api).read_text().strip()
        return env

    @property
    def evidence_dir(self) -> Path:
        """The evidence this stack's gateway earned at run time (extproc/config/earned.py)."""
        return (self.opts.evidence_dir or self.opts.state_dir / "evidence").resolve()

    @property
    def admin_token_file(self) -> Path:
        """The token the workers' status servers want for POST /reload."""
        return self.opts.state_dir / ADMIN_TOKEN

    @property
    def store_url(self) -> str | None:
        """gateway.yaml's store, else the Valkey this stack starts (None: neither)."""
        return self.snapshot.gateway.store.url or (
            f"redis://127.0.0.1:{self.opts.valkey_port or 6379}/0" if self.opts.with_valkey else None)

    def _store_args(self) -> list[str]:
        """ext_proc reads gateway.yaml's store itself; the stack's own Valkey it is told about."""
        url = self.store_url
        return ["--store-url", url] if url and not self.snapshot.gateway.store.url else []

    def _start_extprocs(self) -> list[Ready]:
        env = self._extproc_env()
        # The workers' metrics, one directory for the host (prometheus-client's multiprocess mode):
        # emptied first, so a new start counts from zero.
        metrics = self.opts.state_dir / "metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir(parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)
        env[earned.ENV] = str(self.evidence_dir)
        if self.opts.traces:
            env["LLMGW_TRACES_FILE"] = str(self.traces_file)
        env.update(self.opts.extproc_env)
        pools = [f"--pool={name}=" + ",".join(f"{h}:{p}" for h, p in hosts)
                 for name, hosts in self.render.pools.items()]
        mtls = self.render.tls.extproc
        tls_args = ["--tls-cert", mtls.server_cert_file, "--tls-key", mtls.server_key_file,
                    "--tls-client-ca", mtls.ca_file] if mtls else []
        token = ensure_admin_token(self.opts.state_dir)  # the status servers' POST /reload takes it
        for (host, port), status in zip(self.render.extproc, self.status_ports, strict=True):
            probe = partial(answers, f"http://127.0.0.1:{status}{WORKER_HEALTH_PATH}")
            if host.startswith(UNIX):  # one a worker left behind would refuse the bind
                Path(host.removeprefix(UNIX)).unlink(missing_ok=True)
            listen = host if host.startswith(UNIX) else f"{host}:{port}"
            self.extprocs.append(Child(f"extproc-{port}", python_module(
                self.opts.extproc_module, "--config", str(self.snapshot.directory), "--listen", listen, *pools,
                "--status-listen", f"127.0.0.1:{status}", "--admin-token-file", str(token),
                "--loops-state", str(self.loops_state),
                *tls_args, *self._store_args(),
                # One worker scrapes the engines for all of this gateway's workers.
                "--picker-dir", str(self.opts.state_dir / "picker"),
                *self.opts.extproc_args, *(["--no-picker"] if self.opts.pool_lb != "picker" else []),
                *(["--region", self.opts.region] if self.opts.region else [])),
                self.logs / f"extproc-{port}.log", env=env, probe=probe).start())
        # Ready when its own status endpoint names this revision: the status server starts after the
        # gRPC port is bound, and an open port alone could be another process's.
        return [(partial(self._serves_revision, url), f"ext_proc {host}:{port}", child, 0.0)
                for (host, port), child, url in zip(self.render.extproc, self.extprocs, self.status_urls, strict=True)]

    def _serves_revision(self, status_url: str) -> bool:
        return bool(json_at(status_url).get("revision") == self.snapshot.revision)

    def _start_envoy(self, config: bytes, timeout: float) -> None:
        if self.render.admin_socket:  # a socket left by an Envoy that did not stop cleanly
            Path(self.render.admin_socket).unlink(missing_ok=True)
        path = self.opts.state_dir / "envoy.pb"
        path.write_bytes(config)
        argv = [str(envoy_binary()), "-c", str(path), "--log-level", "warn", "--disable-hot-restart",
                "--file-flush-interval-msec", "250"]  # access log lines reach envoy.log within 250 ms
        if self.opts.envoy_concurrency:
            argv += ["--concurrency", str(self.opts.envoy_concurrency)]
        self.envoy = Child("envoy", argv, self.logs / "envoy.log", env=envoy_env()).start()
        wait_until(lambda: http_ok(f"{self.admin_url}/ready"), timeout, "envoy", self.envoy)
        wait_until(self._pool_healthy, timeout, "engine pool health checks", self.envoy)

    def _pool_healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.admin_url}/clusters", timeout=1) as r:
            text = r.read().decode()
        want = {f"pool_{p}::{h}:{port}::health_flags::healthy"
                for p, hosts in self.render.pools.items() for h, port in hosts}
        return want <= set(text.splitlines())

    def stop(self) -> None:
        for child in self.children():
            child.stop()

    @property
    def loops_state(self) -> Path:
        """Where `llmgw up`'s supervised loops write their state (llmgw/ops/loops.py); the workers serve it."""
        return self.opts.state_dir / LOOPS_STATE

    def advertised_answer(self) -> bool:
        """Whether every endpoint up.json advertises answers now: the listener, Envoy's admin, each
        worker's status and the metrics, the store, the engines and simulated providers."""
        host, port = self.render.listen
        store = urllib.parse.urlsplit(self.store_url or "")
        return (tcp_open(host, port) and answers(f"{self.admin_url}/ready") and answers(self.metrics_url)
                and all(answers(u) for u in self.status_urls)
                and (not store.hostname or tcp_open(store.hostname, store.port or 6379))
                and all(answers(f"http://{h}:{p}/health") for h, p in self.engine_addresses()))

    def engine_addresses(self) -> list[tuple[str, int]]:
        """The engines and simulated providers this stack started."""
        return [hp(addr) for addr in self.engines]

    def write_up_json(self, timeout: float = 30.0) -> Path:
        """up.json, written once every endpoint it advertises answers (a client that reads it at once
        finds each of them serving), atomically (never half a file)."""
        wait_until(self.advertised_answer, timeout, "the endpoints up.json advertises", self.envoy)
        path = self.opts.state_dir / "up.json"
        part = path.with_suffix(".json.part")
        part.write_text(json.dumps({
            "url": self.url, "admin_url": self.admin_url, "revision": self.snapshot.revision,
            "tenants": {t: {"api_key": k} for t, k in self.demo_keys().items()},
            "engines": self.engine_urls(), "logs": str(self.logs), "extproc_status": self.status_urls,
            "admin_token_file": str(self.admin_token_file),
            "providers": {name: [f"http://{h}:{p}" for h, p in hosts] for name, hosts in self.render.providers.items()},
            "store_url": self.store_url, "metrics_url": self.metrics_url,
            **({"traces_file": str(self.traces_file)} if self.opts.traces else {}),
            **({"ca_file": str(self.opts.state_dir / "tls" / "ca.crt")} if self.render.tls.listener else {}),
        }, indent=2) + "\n")
        part.replace(path)
        return path


def socket_path(state_dir: Path, name: str) -> Path:
    """A Unix socket of this stack's, in `sockets/` of the state directory (owner-only, 0700), or - when
    that path is longer than a socket's name may be - in an owner-only directory in the temporary
    directory, named after the state directory."""
    folder = state_dir / "sockets"
    if len(str(folder / name)) >= 100:
        folder = Path(tempfile.gettempdir()) / f"llmgw-{hashlib.sha256(str(state_dir).encode()).hexdigest()[:12]}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder / name


def gateway_processes(stack: Stack) -> dict[str, list[Child]]:
    """A running gateway's processes by kind, as the benchmarks report their cost."""
    return {"envoy": [c for c in [stack.envoy] if c is not None], "ext_proc": list(stack.extprocs),
            "store": [c for c in [stack.valkey] if c is not None]}
