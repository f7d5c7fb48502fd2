"""Demo API keys for `llmgw up`: made at first start, never shipped.

Every tenant of the policy that has no usable API key gets one, id `<tenant>-demo`, marked `demo: true`
in the policy directory's `keys.yaml` (as a SHA-256 hash, like every key). The keys themselves live in
the state directory (`demo-keys.json`, mode 0600), so later starts can hand them out again through
`up.json`; a state directory that lost them gets new ones (the old hashes are replaced). A gateway
never listens beyond loopback while a demo key is configured (`refuse_exposed`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from datetime import date
from pathlib import Path

from extproc.config import Snapshot, load_snapshot
from extproc.config.schema import ManagedKey
from llmgw.ops.keys import KEY_PREFIX, read_keys, write_keys

STATE_FILE = "demo-keys.json"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_demo_keys(config_dir: Path, state_dir: Path) -> tuple[dict[str, str], list[str]]:
    """(tenant -> demo key, tenants whose key was made now)."""
    snap = load_snapshot(config_dir)
    kept_path = state_dir / STATE_FILE
    kept: dict[str, str] = json.loads(kept_path.read_text()) if kept_path.is_file() else {}
    usable = {(o.tenant, h) for h, o in snap.keys_by_hash.items() if not o.key.revoked}
    keys, made = {}, []
    entries = read_keys(config_dir / "keys.yaml")
    for tenant in sorted(snap.gateway.tenants):
        key = kept.get(tenant)
        if key is not None and (tenant, _sha(key)) in usable:
            keys[tenant] = key
            continue
        if any(t == tenant and not snap.keys_by_hash[h].key.demo for t, h in usable):
            continue  # a tenant with keys of its own needs no demo key
        key = KEY_PREFIX + "demo-" + secrets.token_urlsafe(24)
        entries = [e for e in entries if e["id"] != f"{tenant}-demo"]
        entries.append(ManagedKey(id=f"{tenant}-demo", tenant=tenant, sha256=_sha(key), demo=True,
                                  created=date.today()).model_dump(mode="json", exclude_defaults=True))
        keys[tenant] = key
        made.append(tenant)
    if made:
        write_keys(config_dir / "keys.yaml", entries)
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = kept_path.with_suffix(".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(keys, indent=2) + "\n")
        os.replace(tmp, kept_path)
    return keys, made


def refuse_exposed(snap: Snapshot, listen_host: str) -> str | None:
    """The error to stop with when demo keys would be reachable beyond loopback, else None."""
    ids = snap.demo_keys_exposed_on(listen_host)
    if not ids:
        return None
    return (f"refusing to listen on {listen_host} while demo keys are configured ({', '.join(ids)} in "
            f"{snap.directory / 'keys.yaml'}): revoke them with `llmgw keys revoke ID` and make real ones "
            "with `llmgw keys create`, or listen on loopback")
