"""Admission held across two gateway replicas on one store (issue 33, items 3 and 4): a hosted
deployment's provider quota - every request is reserved against it (and its tenant's share) in the
store before any byte leaves; beyond it a plan goes to its next candidate, or the caller gets 429
`overloaded` with Retry-After; the provider never receives more than the quota, counted at the
providers themselves - and a pool's bound, whichever replica admits."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import yaml

from extproc.store import slots_key
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, stamp_evidence, start_stack
from tests.helpers import assert_contract_error, inject_fault, request
from tests.promtext import store_rounds

pytestmark = pytest.mark.e2e
RPM = 12  # the agreed requests per minute: a bucket of 12, refilled one every 5 s
GLOBEX_SHARE = 0.25  # globex may take 3 of them


def quota_policy(tmp: Path, store_url: str | None = None, rpm: int = RPM) -> Path:
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    path = policy / "deployments/demo-anthropic.yaml"
    dep = yaml.safe_load(path.read_text())
    dep["provider_quota"] = {"requests_per_minute": rpm, "tokens_per_minute": 2_000_000,
                             "tenant_shares": {"globex": GLOBEX_SHARE}}
    path.write_text(yaml.safe_dump(dep))
    # A plan whose first candidate is the hosted one and whose next is the pool.
    route = yaml.safe_load((policy / "routes/chat-fallback.yaml").read_text())
    route["route_contract"] = "chat-hosted-first"
    route["candidates"].reverse()
    (policy / "routes/chat-hosted-first.yaml").write_text(yaml.safe_dump(route))
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["pools"]["engine-pool"]["admission"] = {"max_in_flight": 2}
    gw["request_classes"]["read_only_chat"]["queue_ttl_ms"] = 1000
    if store_url is not None:  # the second replica: the first one's store
        gw["store"]["url"] = store_url
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    stamp_evidence(policy, "demo-anthropic", "pool-llama-8b")  # the quota agreed is another one
    return policy


@contextlib.contextmanager
def two_replicas(tmp: Path, rpm: int) -> Iterator[tuple[Stack, Stack]]:
    a = start_stack(tmp / "a", quota_policy(tmp / "pa", rpm=rpm), simulate_providers=True)
    b = None
    try:
        b = start_stack(tmp / "b", quota_policy(tmp / "pb", a.store_url, rpm), simulate_providers=True,
                        with_valkey=False)
        yield a, b
    finally:
        if b is not None:
            b.stop()
        a.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    with two_replicas(tmp_path_factory.mktemp("provider-quota"), RPM) as both:
        yield both


def provider_url(s: Stack) -> str:
    assert s.opts.provider_ports is not None
    return f"http://127.0.0.1:{s.opts.provider_ports['demo-anthropic'][0]}"


def received(stacks: tuple[Stack, ...]) -> int:
    return sum(len(request(f"{provider_url(s)}/admin/requests").json()) for s in stacks)


def send(s: Stack, tenant: str, route: str = "chat-anthropic") -> tuple[int, dict[str, str], bytes]:
    r = request(f"{s.url}/v1/chat/completions", "POST",
                {"model": route, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]},
                {"authorization": f"Bearer {DEMO_KEYS[tenant]}"}, timeout=30)
    if r.status != 200:
        assert_contract_error(r, 429, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
    return r.status, r.headers, r.body


def test_a_provider_quota_and_a_tenant_s_share_hold_across_two_replicas(replicas: tuple[Stack, Stack]) -> None:
    for s in replicas:
        request(f"{provider_url(s)}/admin/requests", "DELETE")
    started = time.monotonic()
    # globex offers 8 through both replicas: its share is 3 of the 12.
    globex = [send(replicas[i % 2], "globex")[0] for i in range(8)]
    # acme offers 20 more: the 9 left of the deployment's 12.
    acme = [send(replicas[i % 2], "acme")[0] for i in range(20)]
    elapsed = time.monotonic() - started
    print(f"provider quota: globex admitted {globex.count(200)} of 8, acme {acme.count(200)} of 20, "
          f"providers received {received(replicas)}, in {elapsed:.1f} s")
    refill = int(RPM * elapsed / 60) + 1  # what the bucket regained while the test ran (one every 5 s)
    assert 3 <= globex.count(200) <= 3 + refill, globex
    assert globex.count(200) + acme.count(200) <= RPM + refill, (globex, acme)
    assert acme.count(200) >= RPM - globex.count(200), acme  # the rest of the quota was not lost
    # The providers (one per replica) received exactly what was admitted: never more than the quota.
    assert received(replicas) == globex.count(200) + acme.count(200)


def test_a_spent_quota_sends_a_plan_to_its_next_candidate(replicas: tuple[Stack, Stack]) -> None:
    a, b = replicas
    while send(a, "acme")[0] == 200:  # spend whatever the bucket regained
        pass
    status, headers, body = send(b, "acme", "chat-hosted-first")
    assert status == 200, body
    entry = ledger_of(a, headers["x-request-id"], "acme")  # one store: the ledger is the replicas' one
    assert entry["admission"] == "skipped=demo-anthropic:provider_quota", entry
    assert [x["deployment"] for x in entry.get("attempts") or [{"deployment": entry.get("deployment")}]] == [
        "pool-llama-8b"], entry


def test_a_pool_s_bound_holds_whichever_replica_admits(replicas: tuple[Stack, Stack]) -> None:
    a, b = replicas
    store = redis.Redis.from_url(str(a.store_url), decode_responses=True)

    def chat(s: Stack, content: str) -> tuple[int, dict[str, str], bytes]:
        r = request(f"{s.url}/v1/chat/completions", "POST",
                    {"model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": content}]},
                    {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
        return r.status, r.headers, r.body

    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(chat, s, inject_fault(s.engine_urls("engine-pool"), "delay_ms=2500")) for s in replicas]
        deadline = time.monotonic() + 10
        while store.zcard(slots_key("engine-pool")) < 2:  # one slot taken through each replica
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, headers, body = chat(a, "a third, through the first replica")
        assert status == 429 and headers["retry-after"], body
        assert b"overloaded" in body
        assert all(f.result()[0] == 200 for f in held)
    waited = chat(b, "after both are done")
    assert waited[0] == 200


def test_a_fallback_attempt_is_held_to_its_candidates_quota(replicas: tuple[Stack, Stack]) -> None:
    """The pool first, the hosted candidate next (chat-fallback): the decision takes a pool slot and
    none of the hosted quota. With that quota spent and the pool failing, the fallback attempt takes
    from the quota before it is sent - and is refused 429 `overloaded` with retry-after instead of
    going past what was agreed: the provider receives nothing."""
    a, _ = replicas
    marker = inject_fault(a.engine_urls("engine-pool"), "status=503", count=4)
    while send(a, "acme")[0] == 200:  # spend whatever the bucket regained (one every 5 s): just before
        pass
    request(f"{provider_url(a)}/admin/requests", "DELETE")
    r = request(f"{a.url}/v1/chat/completions", "POST",
                {"model": "chat-fallback", "max_tokens": 4, "messages": [{"role": "user", "content": marker}]},
                {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=30)
    assert_contract_error(r, 429, "overloaded")
    assert int(r.headers["retry-after"]) >= 1 and r.headers.get("x-should-retry") == "true"
    assert received((a,)) == 0  # the provider saw no attempt
    entry = ledger_of(a, r.headers["x-request-id"], "acme")
    assert [(x["deployment"], x["status"]) for x in entry["attempts"]] == [("pool-llama-8b", 503),
                                                                         ("demo-anthropic", 429)], entry


SLICED_RPM = 240  # room for slices: each worker takes up to 16 requests' worth (1/8 of the room) at once


def test_sliced_provider_quota_holds_across_two_replicas(tmp_path: Path) -> None:
    """A quota large enough to be sliced (extproc/provider_quota.py): both replicas admit from slices
    of it, 16 requests at a time, and near the quota one by one. The providers still receive no more
    than the quota (and what refilled meanwhile), and what the slices held unused comes back: the
    quota is used to within one slice's share of its room."""
    with two_replicas(tmp_path, SLICED_RPM) as (a, b):
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            out = list(pool.map(lambda i: send((a, b)[i % 2], "acme")[0], range(SLICED_RPM + 60)))
        elapsed = time.monotonic() - started
        got = received((a, b))
        sliced, alone = (sum(store_rounds(s.metrics_url, op) for s in (a, b)) for op in ("take_quota", "quota"))
    refill = int(SLICED_RPM * elapsed / 60) + 1
    print(f"sliced provider quota: admitted {out.count(200)} of {len(out)}, providers received {got}, "
          f"in {elapsed:.1f} s; quota round trips: {sliced:.0f} slices, {alone:.0f} alone")
    assert got == out.count(200)  # each admitted request reached a provider once
    assert sliced >= 1 and sliced + alone < out.count(200) / 2, (sliced, alone)  # most came from slices
    assert out.count(200) <= SLICED_RPM + refill, out.count(200)
    assert out.count(200) >= SLICED_RPM * (1 - 1 / 8), out.count(200)
