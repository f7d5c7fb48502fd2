"""Revisions as an audited history (issue 16, part 1): every revision applied or rolled back through
`llmgw apply` / `llmgw rollback` - accepted or refused, with who, when, why and what changed - kept
append-only in the store (a stream), with each accepted revision's files, so any of them can be made
current again through the same checks.

What a revision's files are: every YAML, Rego and JSON file of the policy directory except
`keys.yaml` (API keys are managed on their own: a rollback never brings a revoked key back) and files
that a `file:` credential reference names (secrets never enter the store). A rollback writes those
files back over the directory's own, leaving keys and credential files as they are; when keys changed
since, the restored directory's revision hash differs from the one rolled back to (the hash covers
keys), and the history says both.

The checks, for an apply and a rollback alike: the directory loads (every cross-check of the loader),
the Rego tests pass, no deprecation inside its warning window lacks a qualified replacement, and
every route has a candidate with passing, unexpired evidence (a revision whose evidence has expired
would take its routes out of service: refused, with the reason).
"""

from __future__ import annotations

import argparse
import base64
import difflib
import getpass
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import redis
import yaml

from extproc.config import ConfigError, Snapshot, load_snapshot
from extproc.config.policy_tests import run_isolated
from llmgw.ops import deprecations

HISTORY_KEY = "{llmgw}:revisions"  # a stream: one entry per apply or rollback, accepted or refused
MAX_BUNDLE_BYTES = 8 * 1024 * 1024
SUFFIXES = (".yaml", ".yml", ".rego", ".json")
NOT_BUNDLED = ("keys.yaml",)


def bundle_key(revision: str) -> str:
    return f"{{llmgw}}:revision:{revision}"


def _credential_files(directory: Path) -> set[str]:
    """Files the policy names as `file:` credential references (relative paths): never bundled."""
    found: set[str] = set()
    for path in directory.rglob("*.yaml"):
        for ref in re.findall(r"file:([^\s'\"]+)", path.read_text(errors="replace")):
            found.add(str(Path(ref)))
    return found


def policy_files(directory: Path) -> dict[str, bytes]:
    """relative path -> content of every file a revision consists of."""
    secrets = _credential_files(directory)
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        if (path.is_file() and path.suffix in SUFFIXES and path.name not in NOT_BUNDLED and rel not in secrets
                and not any(part.startswith(".") for part in path.relative_to(directory).parts)):
            out[rel] = path.read_bytes()
    return out


def pack(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel, content in sorted(files.items()):
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(content), 0, 0o644
            tar.addfile(info, io.BytesIO(content))
    data = buf.getvalue()
    if len(data) > MAX_BUNDLE_BYTES:
        raise ValueError(f"the policy's files take {len(data)} bytes packed, more than {MAX_BUNDLE_BYTES}")
    return data


def unpack(data: bytes) -> dict[str, bytes]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts:
                raise ValueError(f"a revision's files hold an unsafe path {member.name!r}")
            f = tar.extractfile(member)
            out[member.name] = f.read() if f is not None else b""
    return out


# --- what changed ---------------------------------------------------------------------------------------

KINDS = (  # (kind, file pattern, field pattern): the first that matches names a change
    ("adapter", r"deployments/", r"fingerprint\.adapter"),
    ("scheduler and picker", r"deployments/", r"fingerprint\.(batching_policy|kv_cache_policy|decoding_policy)"),
    ("engine endpoints", r"deployments/", r"endpoints"),
    ("prices", r"deployments/", r"prices"),
    ("model deployment", r"deployments/", r""),
    ("route", r"routes/", r""),
    ("engine endpoints", r"gateway\.yaml$", r"pools\.[^.]+\.endpoints"),
    ("scheduler and picker", r"gateway\.yaml$", r"pools\."),
    ("budgets and quotas", r"gateway\.yaml$", r"(budgets|quotas)"),
    ("policy", r"\.rego$", r""),
    ("evidence", r"evidence/", r""),
    ("gateway", r"gateway\.yaml$", r""),
    ("other", r"", r""),
)


def kind_of(rel: str, key: str) -> str:
    return next(k for k, file, field in KINDS if re.search(file, rel) and re.match(field, key))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _walk(old: Any, new: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            yield from _walk(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
    elif old != new:
        yield path, f"{_short(old)} -> {_short(new)}"


@dataclass(frozen=True)
class Change:
    kind: str
    file: str
    what: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.file}: {self.what}"


def changes(old: dict[str, bytes], new: dict[str, bytes], limit: int = 40) -> list[Change]:
    """What differs between two revisions' files, per file and field."""
    out: list[Change] = []
    for rel in sorted(set(old) | set(new)):
        a, b = old.get(rel), new.get(rel)
        if a == b:
            continue
        if a is None or b is None:
            out.append(Change(kind_of(rel, ""), rel, "added" if a is None else "removed"))
        elif rel.endswith((".yaml", ".yml")):
            try:
                pairs = list(_walk(yaml.safe_load(a), yaml.safe_load(b), ""))
            except yaml.YAMLError:
                pairs = [("", "changed (not YAML)")]
            out += [Change(kind_of(rel, key), rel, f"{key}: {what}" if key else what) for key, what in pairs]
        else:
            diff = list(difflib.unified_diff(a.decode(errors="replace").splitlines(),
                                             b.decode(errors="replace").splitlines(), lineterm="", n=0))
            added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
            removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
            out.append(Change(kind_of(rel, ""), rel, f"changed (+{added} -{removed} lines)"))
    return out[:limit] + ([Change("other", "...", f"{len(out) - limit} more")] if len(out) > limit else [])


# --- the checks ------------------------------------------------------------------------------------------


def check(directory: Path, today: date | None = None) -> tuple[Snapshot | None, list[str]]:
    """(the snapshot, why it may not become current: empty when it may)."""
    today = today or date.today()
    try:
        snap = load_snapshot(directory, today)
    except ConfigError as e:
        return None, [str(i) for i in e.issues]
    problems = []
    report = run_isolated(snap.rego, snap.policy_data)
    problems += [f"policy test {r.name}: {r.outcome}" for r in report.results if not r.passed]
    problems += report.load_errors
    problems += [f.text for f in deprecations.findings(snap, today) if f.error]
    for name, route in sorted(snap.routes.items()):
        expired = [c.deployment_name for c in route.candidates
                   if snap.missing_evidence(route, c.deployment_ref, today)]
        if len(expired) == len(route.candidates):
            problems.append(f"route {name}: no candidate has passing, unexpired evidence ({', '.join(expired)})")
    return snap, problems


# --- the history -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    time: float
    who: str
    action: str  # apply | rollback | start | sync (a region took the control plane's current revision)
    revision: str  # the revision made current (or refused)
    accepted: bool
    why: list[str]  # a refusal's reasons
    changes: list[str]
    previous: str  # the revision current before
    target: str = ""  # a rollback's: the revision asked for

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Entry:
        doc = json.loads(fields["entry"])
        return cls(**doc)


def history(client: Any) -> list[Entry]:
    return [Entry.from_fields(f) for _, f in client.xrange(HISTORY_KEY)]


def current(client: Any) -> Entry | None:
    """The last accepted entry: the revision the history says is current."""
    return next((e for e in reversed(history(client)) if e.accepted), None)


def record(client: Any, entry: Entry, files: dict[str, bytes] | None) -> None:
    """Append the entry (and keep an accepted revision's files, once per revision)."""
    if files is not None:
        client.set(bundle_key(entry.revision), base64.b64encode(pack(files)), nx=True)
    client.xadd(HISTORY_KEY, {"entry": json.dumps(entry.__dict__)})


def files_of(client: Any, revision: str) -> dict[str, bytes] | None:
    data = client.get(bundle_key(revision))
    return unpack(base64.b64decode(data)) if data else None


def now() -> float:
    return round(time.time(), 3)


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


class ControlPlaneUnreachable(Exception):
    pass
