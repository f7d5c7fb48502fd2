"""`llmgw apply`, `llmgw rollback REV` and `llmgw revisions`: make a policy directory's revision
current through the checks, make an earlier one current again through the same checks, and list the
audited history (llmgw/revisions.py). After an accepted apply or rollback the running workers are told
to reload (each ext_proc's POST /reload, from `llmgw up`'s up.json or --reload-url) and each must then
serve the new revision.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import redis

from extproc.config import ConfigError, load_snapshot
from llmgw.cli_common import store_client
from llmgw.ledger_cmd import store_url
from llmgw.revisions import Entry, changes, check, current, files_of, history, now, policy_files, record

OPERATOR_ENV = "LLMGW_OPERATOR"


def operator(args: argparse.Namespace) -> str:
    """Who: --who, else $LLMGW_OPERATOR, else the login name."""
    return str(getattr(args, "who", None) or os.environ.get(OPERATOR_ENV) or getpass.getuser())


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Make the directory's revision files exactly `files` (each replaced atomically); keys.yaml and
    credential files are not revision files and stay."""
    for rel in set(policy_files(directory)) - set(files):
        (directory / rel).unlink()
    for rel, content in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.replace(tmp, path)


def _staged(directory: Path, files: dict[str, bytes], today: date | None) -> tuple[str, list[str]]:
    """(revision, problems) of the directory with `files` as its revision files, checked on a copy
    (keys and credential files are the directory's own)."""
    with tempfile.TemporaryDirectory(prefix="llmgw-stage-") as tmp:
        stage = Path(tmp) / "policy"
        shutil.copytree(directory, stage)
        write_files(stage, files)
        snap, problems = check(stage, today)
    return (snap.revision if snap else "-"), problems


def apply(client: Any, directory: Path, who: str, today: date | None = None, source: Path | None = None) -> Entry:
    """Make the directory's revision current; with `source`, that directory's revision files, written
    into `directory` only once they pass the checks (the workers watch `directory`: an edit made there
    directly is live before anyone applied it)."""
    files = policy_files(source or directory)
    revision, problems = _staged(directory, files, today)
    cur = current(client)
    before = (files_of(client, cur.revision) if cur else None) or policy_files(directory)
    entry = Entry(now(), who, "apply", revision, not problems, problems,
                  [str(c) for c in changes(before, files)], cur.revision if cur else "")
    if entry.accepted and source is not None:
        write_files(directory, files)
    record(client, entry, files if entry.accepted else None)
    return entry


def record_start(client: Any, directory: Path, who: str) -> Entry | None:
    """`llmgw up` started serving the directory's revision: in the history (with its files, so it can be
    rolled back to) unless it is already the current one. Not checked again: it is already serving."""
    snap = load_snapshot(directory)
    cur = current(client)
    if cur is not None and cur.revision == snap.revision:
        return None
    files = policy_files(directory)
    before = (files_of(client, cur.revision) if cur else None) or files
    entry = Entry(now(), who, "start", snap.revision, True, [], [str(c) for c in changes(before, files)],
                  cur.revision if cur else "")
    record(client, entry, files)
    return entry


def rollback(client: Any, directory: Path, target: str, who: str, today: date | None = None) -> Entry:
    """`target`'s files over the directory's, if the result passes the checks (checked on a copy)."""
    cur = current(client)
    wanted = files_of(client, target)
    previous = cur.revision if cur else ""
    if wanted is None:
        entry = Entry(now(), who, "rollback", "-", False, [f"no revision {target} in the history"], [], previous,
                      target)
        record(client, entry, None)
        return entry
    revision, problems = _staged(directory, wanted, today)
    entry = Entry(now(), who, "rollback", revision, not problems, problems,
                  [str(c) for c in changes(policy_files(directory), wanted)], previous, target)
    if entry.accepted:
        write_files(directory, wanted)
    record(client, entry, wanted if entry.accepted else None)
    return entry


class ControlPlaneUnreachable(Exception):
    pass


def sync(control: Any, local: Any, directory: Path, who: str, today: date | None = None) -> Entry | None:
    """Make the control plane's current revision this region's, through the same checks as a rollback
    (on a copy; the region's keys and credential files are its own), recorded in the region's own
    history. None when the directory already holds it. When the control plane cannot be read, nothing
    changes: the region keeps serving its last known good revision (ControlPlaneUnreachable)."""
    try:
        cur = current(control)
        wanted = files_of(control, cur.revision) if cur is not None else None
    except (redis.RedisError, OSError) as e:
        raise ControlPlaneUnreachable(f"{type(e).__name__}: {e}") from None
    if cur is None or wanted is None:
        raise ControlPlaneUnreachable("the control plane holds no revision")
    here = policy_files(directory)
    if here == wanted:
        return None
    local_cur = current(local)
    revision, problems = _staged(directory, wanted, today)
    entry = Entry(now(), who, "sync", revision, not problems, problems, [str(c) for c in changes(here, wanted)],
                  local_cur.revision if local_cur else "", cur.revision)
    if entry.accepted:
        write_files(directory, wanted)
    record(local, entry, wanted if entry.accepted else None)
    return entry


def reload_workers(urls: list[str], revision: str, token: str, timeout_s: float = 10.0) -> list[str]:
    """POST /reload to each worker's status server, with the admin token; what did not end up serving
    `revision`."""
    failed = []
    for status in urls:
        base = status.rsplit("/status", 1)[0]
        deadline = time.monotonic() + timeout_s
        serving = ""
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"{base}/reload", data=b"", method="POST",
                                             headers={"authorization": f"Bearer {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    serving = str(json.loads(r.read()).get("revision"))
            except OSError as e:
                serving = f"unreachable ({e})"
            if serving == revision:
                break
            time.sleep(0.2)
        if serving != revision:
            failed.append(f"{base}: serves {serving}")
    return failed


def admin_token(args: argparse.Namespace) -> str:
    """The workers' admin token: --admin-token-file, else the one `llmgw up`'s up.json names ("" when
    neither: the workers then refuse the reload, and say so)."""
    path = args.admin_token_file
    if path is None:
        up = Path(args.state_dir) / "up.json"
        path = json.loads(up.read_text()).get("admin_token_file") if up.exists() else None
    return Path(path).read_text().strip() if path and Path(path).exists() else ""


def status_urls(args: argparse.Namespace) -> list[str]:
    """The workers' status URLs: --reload-url, else `llmgw up`'s up.json."""
    if args.reload_url:
        return list(args.reload_url)
    up = Path(args.state_dir) / "up.json"
    return list(json.loads(up.read_text()).get("extproc_status", [])) if up.exists() else []


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


def add_parsers(sub: Any) -> None:
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
