"""Revisions as an audited history (issue 16, part 1): `llmgw apply` records who made which revision
current and what changed; `llmgw rollback REV` makes an earlier one current again through the same
checks, for each kind of change; refused revisions are listed with why; a running gateway's workers
take each accepted revision."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from extproc.config import load_snapshot
from llmgw.local.procs import json_at
from llmgw.ops.revisions import HISTORY_KEY, apply, changes, history, policy_files, rollback
from tests.conftest import POLICY, repin, stamp_evidence, start_stack, valkey_url
from tests.helpers import llmgw

DB = 7  # this module's database on the shared test Valkey


@pytest.fixture
def store() -> Iterator[Any]:
    client = redis.Redis.from_url(valkey_url().rsplit("/", 1)[0] + f"/{DB}", decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst, ignore=shutil.ignore_patterns("keys.yaml"))
    (dst / "pool.key").write_text("a credential that never enters the store")
    return dst


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def refingerprint(policy: Path, deployment: str, field: str, value: str) -> None:
    """Change a fingerprint field, re-pin the routes to the new reference, and record the evidence the
    operator earned for it (what `llmgw conformance` and the quality gate would write)."""
    edit(policy / f"deployments/{deployment}.yaml", lambda d: d["fingerprint"].update({field: value}))
    repin(policy, deployment)
    stamp_evidence(policy, deployment)


KINDS: list[tuple[str, Callable[[Path], None]]] = [
    ("adapter", lambda p: refingerprint(p, "pool-llama-8b", "adapter", "openai@1")),
    ("route", lambda p: edit(p / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=20000))),
    ("engine endpoints", lambda p: edit(p / "gateway.yaml",
                                        lambda d: d["pools"]["engine-pool"]["endpoints"].append("127.0.0.1:8103"))),
    ("model deployment", lambda p: edit(p / "deployments/pool-llama-8b.yaml",
                                        lambda d: d.update(context_window=65536))),
    ("scheduler and picker", lambda p: refingerprint(p, "pool-llama-8b", "batching_policy",
                                                     "continuous,max-num-seqs-128,max-batched-tokens-8192")),
    ("policy", lambda p: (p / "authz.rego").write_text((p / "authz.rego").read_text() + "\n# reviewed\n")),
]


@pytest.mark.parametrize(("kind", "change"), KINDS, ids=[k for k, _ in KINDS])
def test_each_kind_of_change_is_recorded_and_rolled_back(store: Any, policy: Path, kind: str,
                                                         change: Callable[[Path], None]) -> None:
    original = apply(store, policy, "alice")
    assert original.accepted, original.why
    files = policy_files(policy)
    change(policy)
    changed = apply(store, policy, "bob")
    assert changed.accepted, changed.why
    assert changed.previous == original.revision != changed.revision
    assert any(c.startswith(f"[{kind}]") for c in changed.changes), changed.changes
    back = rollback(store, policy, original.revision, "carol")
    assert back.accepted, back.why
    assert (back.revision, back.target, back.previous) == (original.revision, original.revision, changed.revision)
    assert policy_files(policy) == files and load_snapshot(policy).revision == original.revision
    assert [(e.who, e.action, e.revision) for e in history(store)] == [
        ("alice", "apply", original.revision), ("bob", "apply", changed.revision),
        ("carol", "rollback", original.revision)]
    assert (policy / "pool.key").exists()  # a credential file is no revision file: untouched
    assert "never enters" not in json.dumps([f for _, f in store.xrange(HISTORY_KEY)])


def test_a_revision_that_fails_a_check_is_refused_and_listed_with_why(store: Any, policy: Path) -> None:
    first = apply(store, policy, "alice")
    (policy / "authz_test.rego").write_text((policy / "authz_test.rego").read_text() + "\ntest_fails if { false }\n")
    refused = apply(store, policy, "mallory")
    assert not refused.accepted and any("test_fails" in w for w in refused.why), refused.why
    assert [e.accepted for e in history(store)] == [True, False]
    out = llmgw("revisions", "--config", str(policy), "--store-url", valkey_url().rsplit("/", 1)[0] + f"/{DB}")
    assert out.returncode == 0, out.stderr
    assert f"| {first.revision} | current |" in out.stdout and "refused: policy test" in out.stdout


def test_a_rollback_to_a_revision_whose_evidence_expired_is_refused_with_the_reason(store: Any,
                                                                                     policy: Path) -> None:
    old = apply(store, policy, "alice")
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=20000))
    new = apply(store, policy, "bob")
    expired = max(e.expires_at for records in load_snapshot(policy).evidence.values() for e in records
                  if e.expires_at is not None) + timedelta(days=1)  # the day after every record expires
    back = rollback(store, policy, old.revision, "carol", today=expired)
    assert not back.accepted and any("no candidate has passing, unexpired evidence" in w for w in back.why)
    assert load_snapshot(policy).revision == new.revision  # nothing written
    missing = rollback(store, policy, "0123456789abcdef", "carol")
    assert not missing.accepted and missing.why == ["no revision 0123456789abcdef in the history"]


def test_changes_name_the_field(policy: Path) -> None:
    before = policy_files(policy)
    edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=20000))
    (policy / "examples/new.rego").write_text("package x\n")
    found = [str(c) for c in changes(before, policy_files(policy))]
    assert found == ["[policy] examples/new.rego: added",
                     "[route] routes/chat-default.yaml: deadline_ms: 30000 -> 20000"]


@pytest.mark.e2e
def test_the_running_workers_take_an_apply_and_a_rollback(tmp_path: Path, policy: Path) -> None:
    stack = start_stack(tmp_path / "state", policy, workers=2)
    try:
        base = ["--config", str(policy), "--store-url", str(stack.store_url)]
        reload = [*(arg for url in stack.status_urls for arg in ("--reload-url", url)),
                  "--admin-token-file", str(stack.admin_token_file)]
        first = llmgw("apply", *base, *reload, "--who", "alice")
        assert first.returncode == 0, first.stderr
        original = load_snapshot(policy).revision
        edit(policy / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=20000))
        second = llmgw("apply", *base, *reload, "--who", "bob")
        assert second.returncode == 0, second.stderr
        changed = load_snapshot(policy).revision
        assert {json_at(u)["revision"] for u in stack.status_urls} == {changed}
        back = llmgw("rollback", original, *base, *reload, "--who", "carol")
        assert back.returncode == 0, back.stderr
        assert {json_at(u)["revision"] for u in stack.status_urls} == {original}
        listed = llmgw("revisions", *base, "--json")
        assert [json.loads(line)["who"] for line in listed.stdout.splitlines()] == ["alice", "bob", "carol"]
    finally:
        stack.stop()


def test_apply_from_a_staging_directory_writes_the_live_one_only_when_it_passes(store: Any, policy: Path,
                                                                              tmp_path: Path) -> None:
    apply(store, policy, "alice")
    staging = tmp_path / "staging"
    shutil.copytree(policy, staging)
    edit(staging / "routes/chat-default.yaml", lambda d: d.update(deadline_ms=20000))
    (staging / "authz_test.rego").write_text((staging / "authz_test.rego").read_text() + "\ntest_fails if { false }\n")
    live = policy_files(policy)
    refused = apply(store, policy, "bob", source=staging)
    assert not refused.accepted and policy_files(policy) == live  # the workers never saw it
    shutil.copy(policy / "authz_test.rego", staging / "authz_test.rego")
    accepted = apply(store, policy, "bob", source=staging)
    assert accepted.accepted, accepted.why
    assert yaml.safe_load((policy / "routes/chat-default.yaml").read_text())["deadline_ms"] == 20000
    assert load_snapshot(policy).revision == accepted.revision
