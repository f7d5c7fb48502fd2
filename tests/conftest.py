"""Fixtures that start the real processes (Envoy, ext_proc, Valkey, simulated engines) on free ports."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from hypothesis import HealthCheck, settings

from extproc.config import load_snapshot
from extproc.config.earned import ENV as EVIDENCE_ENV
from extproc.store import ledger_entry, ledger_key
from llmgw.conformance import demo_evidence
from llmgw.conformance.demo_evidence import simulated_by_up
from llmgw.local.demo_keys import ensure_demo_keys
from llmgw.local.procs import PORT_SLICE_ENV, Child, free_port, tcp_open, valkey_binary, wait_until
from llmgw.local.stack import Stack, StackOptions

ROOT = Path(__file__).resolve().parent.parent

# Parallel workers (pytest-xdist) choose ports from disjoint slices, and so do the processes they start.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ[PORT_SLICE_ENV] = (f"{int(os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw'))}/"
                                  f"{os.environ['PYTEST_XDIST_WORKER_COUNT']}")
# Hypothesis under the suite's own load. Its `too_slow` health check and its deadline time a test in
# wall-clock seconds; `make test` runs three workers and their gateways on two cores, where the same
# strategy takes several times as long as alone, and a clean clone's suite failed a door test on
# `too_slow` that passes alone in a second. Under parallel workers (pytest-xdist) the deadline is 10x
# Hypothesis' default and `too_slow` is left to the runs without them (a module run alone, the Lua
# tier's serial runs), where a strategy that really is slow still fails it; every other health check
# stays on everywhere.
settings.register_profile("parallel", deadline=timedelta(seconds=2), suppress_health_check=[HealthCheck.too_slow])
if "PYTEST_XDIST_WORKER" in os.environ:
    settings.load_profile("parallel")

# The suite's policies keep their earned evidence in their own evidence/ (extproc/config/earned.py): a
# shell that exported a gateway's evidence folder must not lend it to every test.
os.environ.pop(EVIDENCE_ENV, None)
EXAMPLE_POLICY = ROOT / "policy"  # as committed: its tenants have no keys until `llmgw up` makes demo ones
EARNED = ("*-conformance-*.yaml", "*-quality-gate-*.yaml")  # what `llmgw up` may have written into policy/evidence


def _session_policy() -> tuple[Path, dict[str, str]]:
    """The example policy with a demo key for each tenant, as `llmgw up` makes them, in a directory of
    this test session's (the checkout's policy/ is never written)."""
    import atexit
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="llmgw-test-policy-"))
    atexit.register(shutil.rmtree, root, True)
    policy = root / "policy"
    shutil.copytree(EXAMPLE_POLICY, policy, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    # Envoy waits 5 s for a decision here, not the example's 1 s: the suite runs three workers' stacks
    # on two cores, and a worker just started has stalled past 1 s (refused 503, detail
    # ext_proc_error_per-message_timeout_exceeded) in each of four clean-clone runs - an open fault
    # (docs/ARCHITECTURE.md, "Fail closed, twice"), not one each test should fail on. Tests of the
    # timeout itself set their own (e2e/budgets/test_not_processed_e2e.py: 200 ms).
    gateway = yaml.safe_load((policy / "gateway.yaml").read_text())
    gateway["envoy"]["extproc_message_timeout_ms"] = 5000
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gateway, sort_keys=False))
    keys, _ = ensure_demo_keys(policy, root / "state")
    # Its evidence earned as `llmgw up` earns it (every candidate is simulated here), today's: under a
    # clock years ahead too. Records kept in .llmgw/test-evidence spare a later session the runs.
    snap = load_snapshot(policy)
    demo_evidence.ensure(policy, simulated_by_up(snap, "sim", True), cache=ROOT / ".llmgw" / "test-evidence")
    return policy, keys


POLICY, DEMO_KEYS = _session_policy()
# Simulated seconds run 20x faster than real ones: an 8B decode step of ~9 ms takes ~0.5 ms.
TIME_SCALE = 0.05


def make_up_defaults() -> list[tuple[str, int]]:
    """Every TCP port a `make up` on the example policy listens on (its TLS workers' too)."""
    import tempfile

    from extproc.config.schema import GatewayConfig
    from llmgw.cli import DEFAULT_VALKEY_PORT
    from llmgw.render.common import hp

    with tempfile.TemporaryDirectory(prefix="llmgw-defaults-") as state:
        up = Stack(StackOptions(config_dir=POLICY, state_dir=Path(state), valkey_port=DEFAULT_VALKEY_PORT,
                                simulate_providers=True))
        gateway: GatewayConfig = up.snapshot.gateway
        return sorted({(h, p) for h, p, _ in up.ports_to_bind()} | {hp(e) for e in gateway.envoy.extproc})


_HELD: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs as if a developer's `make up` served beside it: each of its default ports is held
    for the whole session (bound, never listening, so a stray connection is refused at once), by the
    one process that outlives every test (pytest's, or xdist's controller). A test process that listens
    on one of them instead of a port it chose free fails, on every run."""
    import socket

    if hasattr(config, "workerinput"):  # an xdist worker: its controller holds them
        return
    for host, port in make_up_defaults():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEADDR: nothing else may bind it
        try:
            s.bind((host, port))
            _HELD.append(s)
        except OSError:  # held already: by a `make up` that does serve
            s.close()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _HELD:
        _HELD.pop().close()


# Long files first: pytest-xdist hands files to its workers in collection order, so the e2e tiers' and
# the slow tier's long files start early and the unit and Lua tiers' short ones fill the last minutes
# (in folder order the fuzz and comparison files started late and ended the run alone on one worker).
# The slow tier after the e2e tiers: its load generators (fuzz, comparison, sweeps) started together
# starve each other's gateways.
TIER_ORDER = {"e2e": 0, "slow": 1, "lua": 2, "unit": 3}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = ROOT / "tests"
    items.sort(key=lambda item: TIER_ORDER.get(item.path.relative_to(tests).parts[0], len(TIER_ORDER))
               if item.path.is_relative_to(tests) else len(TIER_ORDER))


@pytest.fixture(scope="session")
def make_up_serving() -> list[tuple[str, int]]:
    return make_up_defaults()


_VALKEY: list[tuple[Child, str]] = []


def valkey_url() -> str:
    """One real Valkey for the tests that need a store without a whole stack (started on first use,
    stopped at exit). Each test uses its own tenants' keys or flushes what it reads."""
    if not _VALKEY:
        import atexit
        import tempfile

        port, data = free_port(), Path(tempfile.mkdtemp(prefix="llmgw-valkey-"))
        child = Child("valkey-tests", [str(valkey_binary()), "--port", str(port), "--bind", "127.0.0.1",
                                       "--dir", str(data), "--save", "", "--appendonly", "no"],
                      data / "valkey.log").start()
        wait_until(lambda: tcp_open("127.0.0.1", port), 30, "valkey", child)
        atexit.register(child.stop)
        _VALKEY.append((child, f"redis://127.0.0.1:{port}/0"))
    return _VALKEY[0][1]


def ledger_of(stack: Stack, rid: str, tenant: str) -> dict[str, Any]:
    """A request's one ledger entry, once settlement has written it (waits up to 5 s)."""
    r = redis.Redis.from_url(str(stack.store_url), decode_responses=True)
    deadline = time.time() + 5
    while time.time() < deadline:
        found = [e for _, f in r.xrange(ledger_key(tenant)) if (e := ledger_entry(f)).get("request_id") == rid]
        if found:
            (entry,) = found  # exactly one (invariant 8)
            return entry
        time.sleep(0.05)
    raise AssertionError(f"no ledger entry for {rid}")


def ledger_head(stack: Stack, tenant: str = "acme") -> str:
    """The id of the tenant's latest ledger entry ("0-0" when none): where ledger_since starts."""
    r = redis.Redis.from_url(str(stack.store_url), decode_responses=True)
    last = r.xrevrange(ledger_key(tenant), count=1)
    return last[0][0] if last else "0-0"


def ledger_since(stack: Stack, start: str, tenant: str = "acme") -> list[dict[str, Any]]:
    """The tenant's ledger entries written after `start` (a ledger_head)."""
    r = redis.Redis.from_url(str(stack.store_url), decode_responses=True)
    return [ledger_entry(f) for _, f in r.xrange(ledger_key(tenant), min=f"({start}")]


def settled_since(stack: Stack, start: str) -> list[dict[str, Any]]:
    """The ledger entries written since `start`, once settlement has written them all (a stream's
    entry comes when settlement has read its end): until none has come for half a second."""
    deadline, entries, quiet = time.time() + 5, ledger_since(stack, start), time.time() + 0.5
    while time.time() < deadline and (not entries or time.time() < quiet):
        time.sleep(0.1)
        now = ledger_since(stack, start)
        if len(now) != len(entries):
            entries, quiet = now, time.time() + 0.5
    return entries


def serving_directory(stack: Stack, within_s: float = 15.0) -> None:
    """Until every worker serves the revision the stack's policy directory holds now (the workers poll
    it: a test that changed it waits here for the reload)."""
    from tests.helpers import request

    want = load_snapshot(stack.snapshot.directory).revision
    deadline = time.monotonic() + within_s
    while not all(request(u).json().get("revision") == want for u in stack.status_urls):
        if time.monotonic() > deadline:
            raise AssertionError(f"the workers did not take revision {want}")
        time.sleep(0.1)


def stamp_evidence(policy: Path, *deployments: str) -> None:
    """Provisional records for these deployments under the policy's routes as they are now, for a test
    whose subject is not evidence, after it changed what earned records are bound to (a route's retry
    or fallback policy, a fingerprint: invariant 17). Tests of evidence itself earn theirs."""
    from datetime import UTC, datetime

    from llmgw.conformance.record import stamp

    for deployment in deployments:
        stamp(policy, deployment, datetime.now(UTC).date(), valid_days=90)


def repin(policy: Path, deployment: str) -> str:
    """After a change to `deployment`'s fingerprint: every route of the policy names its new reference
    (as an operator accepting the new served system would). Returns the reference."""
    from extproc.config.schema import Deployment

    dep = Deployment.model_validate(yaml.safe_load((policy / f"deployments/{deployment}.yaml").read_text()))
    ref = dep.ref
    for path in (policy / "routes").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        for cand in doc["candidates"]:
            if cand["deployment_ref"].startswith(f"{deployment}@"):
                cand["deployment_ref"], cand["adapter_ref"] = ref, dep.fingerprint.adapter
        path.write_text(yaml.safe_dump(doc))
    return ref


def start_stack(tmp: Path, config: Path = POLICY, **kw: object) -> Stack:
    snap = load_snapshot(config)
    opts = StackOptions.on_free_ports(config, tmp, snap, time_scale=kw.pop("time_scale", TIME_SCALE), **kw)
    return Stack(opts).start()


def module_stack(name: str, make_policy: Callable[[Path], Path], **kw: object) -> Any:
    """A module's own stack on the policy `make_policy(tmp)` writes: use as `gw = module_stack(...)`."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        tmp = tmp_path_factory.mktemp(name)
        s = start_stack(tmp / "state", make_policy(tmp), **kw)
        yield s
        s.stop()
    return fixture


def module_provider(api: str, model: str, key: str, *extra: str) -> Any:
    """A module's own simulated provider of `api`'s shape (enginesim --api) accepting only `key`, its
    URL yielded: use as `provider = module_provider(...)`."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        from llmgw.bench.translated import simulated_provider

        child, url = simulated_provider(api, model, key, tmp_path_factory.mktemp(f"{api}-provider") / "log", 0.02,
                                        *extra)
        yield url
        child.stop()
    return fixture


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, for tests that break a process."""
    s = start_stack(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def acme_key() -> str:
    return DEMO_KEYS["acme"]


@pytest.fixture(scope="session")
def globex_key() -> str:
    return DEMO_KEYS["globex"]


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    """A copy of the example policy directory, for a test to change."""
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    return dst
