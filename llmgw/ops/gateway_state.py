"""A gateway's own state directory: the secrets it makes for itself when its operator gave none, and
where its earned evidence and its loops' state are kept. `llmgw up` and `llmgw init` (docker-compose's
`init` service) prepare it the same way.

The gateway's own secrets are env references by default (gateway.yaml `cache_salt_secret_ref`,
`store.replay_key_ref`). When the environment lacks one, a random key is made once and kept in the state
directory (mode 0600), so restarts and every worker share it: a process is given it as `$NAME`
(`llmgw up`) or as the file `$NAME_FILE` names (containers; extproc/secrets.py).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from extproc.config import Snapshot
from extproc.secrets import env_name

EVIDENCE = "evidence"  # what the gateway earns and voids at run time ($LLMGW_EVIDENCE_DIR)
LOOPS_STATE = "loops.json"
ADMIN_TOKEN = "admin.token"  # the workers' POST /reload bearer token


def new_key(api: str = "") -> str:
    """A random key for the gateway's own secrets or a simulated provider of this API shape: a
    Bedrock-shaped provider's is an AWS key pair (`ACCESS_KEY_ID:SECRET_ACCESS_KEY`) to sign with."""
    if api == "bedrock":
        return f"AKIA{secrets.token_hex(8).upper()}:{secrets.token_urlsafe(30)}"
    return secrets.token_hex(32)


def kept(path: Path, make: Callable[[], str]) -> Path:
    """The secret kept at `path`, made with `make` (mode 0600, before anything is written) when absent."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(make())
    return path


def kept_key(path: Path, api: str = "") -> Path:
    """A key of new_key's kind for this API shape, kept at `path`."""
    return kept(path, lambda: new_key(api))


def own_secret_refs(snap: Snapshot) -> dict[str, str]:
    """Each of the gateway's own secrets the policy refers to by environment variable: file -> name."""
    gw = snap.gateway
    refs = (("cache-salt.key", gw.cache_salt_secret_ref), ("replay.key", gw.store.replay_key_ref))
    return {file: name for file, ref in refs if (name := env_name(ref))}


def ensure_own_secrets(snap: Snapshot, state_dir: Path) -> dict[str, Path]:
    """The gateway's own secrets that the environment does not set, kept in `state_dir`: name -> file."""
    return {name: kept_key(state_dir / file) for file, name in own_secret_refs(snap).items()
            if not os.environ.get(name)}


def ensure_admin_token(state_dir: Path) -> Path:
    """The workers' POST /reload bearer token, kept in the state directory."""
    return kept(state_dir / ADMIN_TOKEN, lambda: secrets.token_urlsafe(32))
