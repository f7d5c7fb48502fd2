"""`llmgw apply`, `llmgw rollback REV` and `llmgw revisions`: make a policy directory's revision
current through the checks, make an earlier one current again through the same checks, and list the
audited history (llmgw/ops/revisions.py). After an accepted apply or rollback the running workers are told
to reload (each ext_proc's POST /reload, from `llmgw up`'s up.json or --reload-url) and each must then
serve the new revision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from extproc.config import ConfigError, load_snapshot
from llmgw.ops.reload import admin_token, reload_workers, status_urls
from llmgw.ops.revisions import OPERATOR_ENV, ControlPlaneUnreachable, Entry, apply, history, operator, rollback, sync
from llmgw.ops.store import store_client, store_url


def _client(args: argparse.Namespace, directory: Path | None) -> Any:
    config_url = None
    if directory is not None:
        try:
            config_url = load_snapshot(directory).gateway.store.url
        except ConfigError:
            config_url = None
    url = store_url(args, config_url)
    if not url:
        raise ValueError("no store: give --store-url, set store.url in gateway.yaml, or run `llmgw up`")
    return store_client(url)


def _report(entry: Entry, args: argparse.Namespace) -> int:
    verb = {"rollback": "rolled back to", "sync": "synced from the control plane"}.get(entry.action, "applied")
    if not entry.accepted:
        print(f"refused: {entry.action} {entry.target or entry.revision}; revision {entry.previous or '-'} stays "
              "current:", file=sys.stderr)
        for why in entry.why:
            print(f"  {why}", file=sys.stderr)
        return 1
    print(f"{verb} {entry.target + ' as ' if entry.target else ''}revision {entry.revision} (by {entry.who}; "
          f"was {entry.previous or '-'})")
    for c in entry.changes:
        print(f"  {c}")
    if args.no_reload:
        return 0
    failed = reload_workers(status_urls(args), entry.revision, admin_token(args))
    for line in failed:
        print(f"error: a worker did not take revision {entry.revision}: {line}", file=sys.stderr)
    return 1 if failed else 0


def cmd_apply(args: argparse.Namespace) -> int:
    directory = Path(args.config).resolve()
    try:
        client = _client(args, directory)
        source = Path(args.source).resolve() if args.source else None
        return _report(apply(client, directory, operator(args), source=source), args)
    except (ValueError, OSError, redis.RedisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_rollback(args: argparse.Namespace) -> int:
    directory = Path(args.config).resolve()
    try:
        client = _client(args, directory)
        return _report(rollback(client, directory, args.revision, operator(args)), args)
    except (ValueError, OSError, redis.RedisError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_sync(args: argparse.Namespace) -> int:
    """Exit 0: in sync (or synced and reloaded); 1: the revision was refused here or a worker did not
    take it; 2: bad arguments or the region's own store unreachable; 3: the control plane unreachable
    (the region serves its last known good revision). With --interval, runs until stopped."""
    directory = Path(args.config).resolve()
    who = operator(args)
    while True:
        try:
            control, local = store_client(args.control_store), _client(args, directory)
            entry = sync(control, local, directory, who)
            if entry is None:
                print(f"in sync: revision {load_snapshot(directory).revision}")
                code = 0
            else:
                code = _report(entry, args)
        except ControlPlaneUnreachable as e:
            print(f"control plane unreachable ({e}); revision {load_snapshot(directory).revision} (last known "
                  "good) keeps serving", file=sys.stderr)
            code = 3
        except (ValueError, OSError, redis.RedisError, ConfigError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        if not args.interval:
            return code
        time.sleep(args.interval)


def cmd_revisions(args: argparse.Namespace) -> int:
    try:
        entries = history(_client(args, Path(args.config) if Path(args.config, "gateway.yaml").exists() else None))
    except (ValueError, OSError, redis.RedisError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        for e in entries:
            print(json.dumps(e.__dict__))
        return 0
    cur = next((e for e in reversed(entries) if e.accepted), None)
    print("| time (UTC) | who | action | revision | result | what changed |\n|---|---|---|---|---|---|")
    for e in entries:
        when = datetime.fromtimestamp(e.time, UTC).strftime("%Y-%m-%d %H:%M:%S")
        result = ("current" if e is cur else "accepted") if e.accepted else "refused: " + "; ".join(e.why[:2])
        what = "; ".join(e.changes[:3]) + (f" (+{len(e.changes) - 3} more)" if len(e.changes) > 3 else "")
        action = {"rollback": f"rollback to {e.target}", "sync": f"sync of {e.target}"}.get(e.action, e.action)
        print(f"| {when} | {e.who} | {action} | {e.revision} | {result} | {what or '-'} |")
    return 0


def register(sub: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", default="policy")
        p.add_argument("--store-url", help="default: gateway.yaml store.url, else llmgw up's (STATE_DIR/up.json)")
        p.add_argument("--state-dir", default=".llmgw")

    def changing(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument("--who", help=f"the operator (default: ${OPERATOR_ENV}, else the login name)")
        p.add_argument("--reload-url", action="append", help="a worker's status URL (default: up.json's)")
        p.add_argument("--admin-token-file", help="the workers' admin token (default: up.json's)")
        p.add_argument("--no-reload", action="store_true", help="record only; the workers reload on their own")

    a = sub.add_parser("apply", help="make the policy directory's revision current, through the checks, audited")
    changing(a)
    a.add_argument("--from", dest="source", help="a staging directory whose revision files are written into "
                   "--config once they pass the checks")
    a.set_defaults(func=cmd_apply)
    r = sub.add_parser("rollback", help="make an earlier revision current again, through the same checks")
    r.add_argument("revision")
    changing(r)
    r.set_defaults(func=cmd_rollback)
    s = sub.add_parser("sync", help="a region: make the control plane's current revision this one's, through the "
                       "checks; when it cannot be read, the last known good revision keeps serving")
    changing(s)
    s.add_argument("--control-store", required=True, help="the control plane's store (redis:// URL): its history")
    s.add_argument("--interval", type=float, default=0, help="seconds between syncs (0: once)")
    s.set_defaults(func=cmd_sync)
    h = sub.add_parser("revisions", help="the audited history of applied, rolled back and refused revisions")
    common(h)
    h.add_argument("--json", action="store_true", help="one JSON object per entry (an export)")
    h.set_defaults(func=cmd_revisions)
