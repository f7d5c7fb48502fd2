"""`llmgw keys`: API keys for the policy directory.

Keys made here go to the policy directory's `keys.yaml` as SHA-256 hashes; the key itself is printed
once and never stored. ext_proc picks the change up with its next reload.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from datetime import date
from pathlib import Path
from typing import Any

from extproc.config.schema import ManagedKey
from llmgw.cli.common import snapshot_or_report
from llmgw.ops.keys import KEY_PREFIX, read_keys, write_keys


def cmd_keys_create(args: argparse.Namespace) -> int:
    root = Path(args.config)
    snap = snapshot_or_report(root)
    if snap is None:
        return 1
    if args.tenant not in snap.gateway.tenants:
        print(f"error: no tenant {args.tenant!r} in {root / 'gateway.yaml'}", file=sys.stderr)
        return 1
    path = root / "keys.yaml"
    keys = read_keys(path)
    key_id = args.id or f"{args.tenant}-{secrets.token_hex(4)}"
    taken = {k["id"] for k in keys} | {k.key.id for k in snap.keys_by_hash.values()}
    if key_id in taken:
        print(f"error: a key with id {key_id!r} exists", file=sys.stderr)
        return 1
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = ManagedKey(id=key_id, tenant=args.tenant, sha256=hashlib.sha256(key.encode()).hexdigest(),
                       expires=args.expires, effects=tuple(args.effect), created=date.today())
    write_keys(path, [*keys, entry.model_dump(mode="json", exclude_defaults=True)])
    print(key)  # the only time the key exists outside the caller's hands
    print(f"key {key_id} for tenant {args.tenant} stored as a hash in {path}", file=sys.stderr)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    path = Path(args.config) / "keys.yaml"
    keys = read_keys(path)
    hit = [k for k in keys if k["id"] == args.id]
    if not hit:
        print(f"error: no key {args.id!r} in {path} (keys in gateway.yaml are revoked there)", file=sys.stderr)
        return 1
    hit[0]["revoked"] = True
    write_keys(path, keys)
    print(f"key {args.id} revoked", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    snap = snapshot_or_report(args.config)
    if snap is None:
        return 1
    for owner in sorted(snap.keys_by_hash.values(), key=lambda o: (o.tenant, o.key.id)):
        k = owner.key
        state = "revoked" if k.revoked else f"expires {k.expires}" if k.expires else "active"
        print(f"{owner.tenant:<12} {k.id:<28} {state}  effects={','.join(k.effects) or '-'}")
    return 0


def register(sub: Any) -> None:
    k = sub.add_parser("keys", help="API keys (stored as hashes in the policy directory's keys.yaml)")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    c = ksub.add_parser("create", help="make a key for a tenant; prints it once")
    c.add_argument("--tenant", required=True)
    c.add_argument("--id", help="key id (default: <tenant>-<random>)")
    c.add_argument("--expires", type=date.fromisoformat, help="last valid day, YYYY-MM-DD")
    c.add_argument("--effect", action="append", default=[], help="a tool effect the key may use (repeatable)")
    c.add_argument("--config", default="policy")
    c.set_defaults(func=cmd_keys_create)
    r = ksub.add_parser("revoke", help="revoke a key by id")
    r.add_argument("id")
    r.add_argument("--config", default="policy")
    r.set_defaults(func=cmd_keys_revoke)
    ls = ksub.add_parser("list", help="every key's tenant, id and state")
    ls.add_argument("--config", default="policy")
    ls.set_defaults(func=cmd_keys_list)
