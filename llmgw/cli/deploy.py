"""`llmgw init` and `llmgw loops`: a gateway's state prepared, and its loops run, as services of their own
(docker-compose.yml's `init` and `loops`; any deployment where `llmgw up` does not run the gateway)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from extproc.config import earned
from llmgw.cli.common import engines_by_pool, snapshot_or_report
from llmgw.ops import gateway_state


def _state(args: argparse.Namespace) -> Path:
    """The state directory, and the earned evidence in it for every command this process runs."""
    state = Path(args.state_dir)
    os.environ[earned.ENV] = str((state / gateway_state.EVIDENCE).resolve())
    return state


def cmd_init(args: argparse.Namespace) -> int:
    """The state directory made ready for the gateway's processes: its own secrets and admin token (made
    once), the demo evidence of the candidates served by simulators; refused when no tenant has a key."""
    from llmgw.cli import earn_demo_evidence

    state = _state(args)
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    if not any(not owner.key.revoked for owner in snap.keys_by_hash.values()):
        print(f"error: no API key in {Path(args.config) / 'keys.yaml'}: no request could be served. Make one with "
              "`llmgw keys create --tenant TENANT` (or run `make up` once for demo keys), then start again",
              file=sys.stderr)
        return 1
    for name, path in gateway_state.ensure_own_secrets(snap, state).items():
        print(f"secret {name}: {path}")
    print(f"admin token: {gateway_state.ensure_admin_token(state)}")
    if earn_demo_evidence(Path(args.config), snap) != 0:
        return 1
    print(f"state ready in {state}")
    return 0


def cmd_loops(args: argparse.Namespace) -> int:
    """The loops at gateway.yaml's intervals until SIGTERM or Ctrl-C."""
    from llmgw.ops.gateway_loops import LoopTargets, start

    state = _state(args)
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    store_url = args.store_url or snap.gateway.store.url
    if not store_url:
        print("error: no store: --store-url or gateway.yaml store.url", file=sys.stderr)
        return 1
    token = Path(args.admin_token_file) if args.admin_token_file else state / gateway_state.ADMIN_TOKEN
    targets = LoopTargets(
        config=Path(args.config), store_url=store_url,
        engines=engines_by_pool(snap, args.engine),
        status_urls=args.status_url, admin_token_file=token if token.exists() else None,
        state_file=state / gateway_state.LOOPS_STATE, intervals=snap.gateway.loops)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    loops = start(targets)
    print(f"loops: {', '.join(f'{n} every {s.interval_s:g}s' for n, s in loops.states.items()) or 'none'}; "
          f"state in {targets.state_file}", flush=True)
    stop.wait()
    loops.stop()
    return 0


def register(sub: Any) -> None:
    i = sub.add_parser("init", help="prepare a state directory: the gateway's own secrets, its admin token, the "
                                    "evidence of simulated candidates (docker-compose's init service)")
    i.add_argument("--config", default="policy")
    i.add_argument("--state-dir", default=".llmgw")
    i.set_defaults(func=cmd_init)
    lo = sub.add_parser("loops", help="run the engine check, re-evaluation and canary watch at gateway.yaml's "
                                      "intervals until stopped (what `llmgw up` runs beside its processes)")
    lo.add_argument("--config", default="policy")
    lo.add_argument("--state-dir", default=".llmgw", help="the voids and the loops' state go here")
    lo.add_argument("--store-url", help="the ledger's store (default: gateway.yaml store.url)")
    lo.add_argument("--engine", action="append", default=[], metavar="POOL=URL",
                    help="an engine of a pool (repeatable; default: the pool's endpoints in gateway.yaml)")
    lo.add_argument("--status-url", action="append", default=[], metavar="URL",
                    help="a worker's status server, reloaded after a canary rollback (repeatable)")
    lo.add_argument("--admin-token-file", help="the workers' admin token (default: STATE_DIR/admin.token)")
    lo.set_defaults(func=cmd_loops)
