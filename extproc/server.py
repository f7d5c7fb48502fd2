"""Starting ext_proc: the command line (`python -m extproc`), the secrets a revision is served with,
mTLS, the picker and the store, the gRPC server (extproc/service/processor.py) beside Envoy's access
log (extproc/settlement/access_log.py), the status server (extproc/service/status.py), the policy
watcher and the sweeper; a clean stop on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

import grpc

from extproc import tracing
from extproc.config import Snapshot, load_snapshot
from extproc.config.reload import Live, Reloader
from extproc.jwks import JwksCache
from extproc.picker import Picker
from extproc.replay import Sealer
from extproc.secrets import SecretUnavailable, resolve
from extproc.service.processor import Processor, add_services
from extproc.service.status import status_app
from extproc.settlement.access_log import SettlementLog
from extproc.settlement.sweeper import Sweeper
from extproc.shadow import grant_key
from extproc.stages.route import tenant_salts
from extproc.store import Store, StoreUnavailable

log = logging.getLogger("llmgw.extproc")


def live_for(snapshot: Snapshot, region: str = "") -> Live:
    """The secrets a revision is served with: the gateway's own stop it when they cannot be resolved
    (fail closed); a deployment's credential that cannot be resolved makes that deployment
    unaddressable (its attempts are refused), and is logged now."""
    ref = snapshot.gateway.store.replay_key_ref
    # The gateway's own secret (a missing one stops the service from starting: fail closed): the
    # tenants' prefix-cache salts and the shadow grants' key derive from it; every host shares it.
    secret = resolve(snapshot.gateway.cache_salt_secret_ref, snapshot.directory)
    live = Live(snapshot, tenant_salts(secret, snapshot.gateway.tenants),
                Sealer(resolve(ref, snapshot.directory) if ref else None), shadow_key=grant_key(secret),
                region=region)
    for dep in snapshot.deployments.values():
        if dep.credential_ref:
            try:
                live.credentials[dep.deployment] = resolve(dep.credential_ref, snapshot.directory)
            except SecretUnavailable as e:
                live.credential_errors[dep.deployment] = str(e)
                log.error("deployment %s cannot be addressed: %s", dep.deployment, e)
    return live


def _peer_gone(record: logging.LogRecord) -> bool:
    """gRPC logs, with a traceback, a stream's final status it could not send because Envoy had already
    closed the stream (its client left): nothing was lost, so it is one line at INFO instead."""
    error = record.exc_info[1] if record.exc_info else None
    if error is not None and type(error).__name__ == "ExecuteBatchError" and "SendStatusFromServer" in str(error):
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.INFO, "INFO", None, None
        record.msg, record.args = "a stream's final status was not sent: Envoy had closed the stream", ()
    return True


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """mTLS for Envoy -> ext_proc: ext_proc presents `cert` and admits only clients signed by the CA."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_server_credentials([(read(key), read(cert))], root_certificates=read(client_ca),
                                       require_client_auth=True)


def pool_endpoints(snapshot: Snapshot, overrides: list[str]) -> dict[str, list[str]]:
    """The engines of each pool: gateway.yaml's, or `--pool NAME=host:port,...` where Envoy was
    rendered with other addresses (llmgw up on free ports)."""
    pools = {name: list(pool.endpoints) for name, pool in snapshot.gateway.pools.items()}
    for item in overrides:
        name, _, eps = item.partition("=")
        if name not in pools:
            raise SystemExit(f"ext_proc: --pool names unknown pool {name!r}")
        pools[name] = [e for e in eps.split(",") if e]
    return pools


async def serve(reloader: Reloader, listen: str, pools: Mapping[str, list[str]] | None = None,
                status_listen: str | None = None, credentials: grpc.ServerCredentials | None = None,
                store_url: str | None = None, picker_dir: Path | None = None,
                admin_token: str | None = None, loops_state: Path | None = None,
                socket_mode: int | None = None) -> None:
    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", 100_000),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.so_reuseport", 0),
    ])
    picker = Picker(pools, shared_dir=picker_dir) if pools else None
    if picker is not None:
        await picker.start()
    if tracing.init():
        log.info("traces exported (%s)", ", ".join(k for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "LLMGW_TRACES_FILE")
                                                   if os.environ.get(k)))
    jwks = JwksCache()
    store_cfg = reloader.live.snapshot.gateway.store
    store_url = store_url or store_cfg.url
    store = Store.from_settings(store_url, store_cfg) if store_url else None
    if store is not None:
        try:
            await store.prepare()
        except StoreUnavailable as e:  # not fatal: requests that need the store are refused until it is back
            log.warning("store not reachable at start (%s); requests that need it are refused until it is", e)
    processor = Processor(reloader, picker, jwks, store)
    settlement_log = (SettlementLog(processor.settler, lambda: reloader.live.snapshot)
                      if processor.settler is not None else None)
    add_services(server, processor, settlement_log)  # JSON answers and streams settle through the access log
    bound = (server.add_secure_port(listen, credentials) if credentials is not None
             else server.add_insecure_port(listen))
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    if socket_mode is not None and listen.startswith("unix:"):
        os.chmod(listen.removeprefix("unix:"), socket_mode)
    runner = (await status_app(reloader, status_listen, processor, settlement_log, picker, admin_token, loops_state)
              if status_listen else None)
    log.info("ext_proc listening on %s%s, revision %s", listen, " (mTLS)" if credentials else "",
             reloader.live.snapshot.revision)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    watcher = asyncio.create_task(reloader.watch(stop))
    sweeper = (asyncio.create_task(Sweeper(store, lambda: reloader.live.snapshot.gateway.tenants).run(stop))
               if store is not None else None)
    await stop.wait()
    await watcher
    if sweeper is not None:
        await sweeper
    await server.stop(grace=2)
    if processor.slices is not None:  # every admission written, every slice given back
        await processor.slices.close()
    if processor.admission is not None:
        await processor.admission.stop()
    tracing.shutdown()
    if runner is not None:
        await runner.cleanup()
    if picker is not None:
        await picker.stop()
    if store is not None:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m extproc", description="llmgw ext_proc service")
    p.add_argument("--config", required=True, help="policy directory")
    p.add_argument("--listen", default="127.0.0.1:50051")
    p.add_argument("--socket-mode", type=lambda v: int(v, 8), metavar="OCTAL",
                   help="with --listen unix:PATH: the socket's mode (default: the umask's). Envoy must be able to "
                        "write to it: where it runs as another user, e.g. 666 in a directory only Envoy and ext_proc "
                        "mount (docker-compose.yml)")
    p.add_argument("--pool", action="append", default=[], metavar="NAME=HOST:PORT,...",
                   help="a pool's engine addresses, where they differ from gateway.yaml's")
    p.add_argument("--no-picker", action="store_true", help="leave engine choice to Envoy's least-request")
    p.add_argument("--picker-dir", type=Path, default=os.environ.get("LLMGW_PICKER_DIR") or None,
                   help="a directory the workers on this host share, so one of them scrapes the engines for all "
                        "(default $LLMGW_PICKER_DIR; none: each worker scrapes)")
    p.add_argument("--status-listen", metavar="HOST:PORT", help="serve GET /status (revision, last reload)")
    p.add_argument("--admin-token-file", type=Path,
                   help="the status server's POST /reload needs this file's token as its bearer credential "
                        "(without it, the endpoint is off: SIGHUP reloads)")
    p.add_argument("--loops-state", type=Path,
                   help="the JSON file `llmgw up`'s supervised loops write their state to (GET /status shows it)")
    p.add_argument("--store-url", help="redis:// URL of the budget store (default: gateway.yaml store.url)")
    p.add_argument("--reload-runs-policy-tests", action="store_true",
                   help="refuse a new revision whose Rego test_* rules fail")
    p.add_argument("--tls-cert", help="mTLS: ext_proc's certificate (PEM)")
    p.add_argument("--tls-key", help="mTLS: ext_proc's private key (PEM)")
    p.add_argument("--tls-client-ca", help="mTLS: CA that signs Envoy's client certificate (PEM)")
    p.add_argument("--no-decision-cache", action="store_true",
                   help="evaluate Rego for every request even when the policy is pure (benchmarks)")
    p.add_argument("--public-address", default=os.environ.get("LLMGW_PUBLIC_ADDRESS", "127.0.0.1"),
                   help="where clients reach the gateway (default $LLMGW_PUBLIC_ADDRESS or loopback): beyond "
                        "loopback, demo keys are refused")
    p.add_argument("--region", default=os.environ.get("LLMGW_REGION", ""),
                   help="the region this gateway runs in: a tenant whose residency excludes it is refused (403)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.no_decision_cache:
        from extproc.config import policy

        policy.DECISION_CACHE = False
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(_peer_gone)
    snapshot = load_snapshot(args.config)
    exposed = snapshot.demo_keys_exposed_on(args.public_address)
    if exposed:
        raise SystemExit(f"ext_proc: refusing to serve a gateway published on {args.public_address} while demo keys "
                         f"are configured ({', '.join(exposed)}): revoke them and make real ones (`llmgw keys`)")
    try:
        live = live_for(snapshot, args.region)
    except SecretUnavailable as e:
        raise SystemExit(f"ext_proc: {e}") from None
    tls = (args.tls_cert, args.tls_key, args.tls_client_ca)
    if any(tls) and not all(tls):
        raise SystemExit("ext_proc: --tls-cert, --tls-key and --tls-client-ca go together")
    credentials = server_credentials(*tls) if all(tls) else None
    import uvloop

    uvloop.install()
    reloader = Reloader(snapshot.directory, functools.partial(live_for, region=args.region), live,
                        run_tests=args.reload_runs_policy_tests)
    pools = None if args.no_picker else pool_endpoints(snapshot, args.pool)
    token = args.admin_token_file.read_text().strip() if args.admin_token_file else None
    asyncio.run(serve(reloader, args.listen, pools, args.status_listen, credentials, args.store_url,
                      args.picker_dir, token or None, args.loops_state, args.socket_mode))
