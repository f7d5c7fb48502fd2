"""A request Envoy answered itself because its decision never arrived (issue 27, item 4): the worker
reserved for it, then took longer than Envoy's message timeout (here a prompt of 3 MB of addresses to
redact, after the reservation, against a 200 ms timeout). Envoy answers 503 `policy_unavailable`, no
upstream sees the request, and the reservation is released at once from the access log - not left to
its lease, which would expire seconds later and charge it in full as ambiguous."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import yaml

from extproc.store import leases_key
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, repin
from tests.helpers import Response, assert_contract_error, request, request_quietly, unique_marker

pytestmark = pytest.mark.e2e


def slow_decisions(tmp: Path, message_timeout_ms: int = 200) -> Path:
    """The example policy with a 200 ms message timeout and a pool whose window holds a 3 MB prompt."""
    import shutil
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    dep = yaml.safe_load((policy / "deployments/pool-llama-8b.yaml").read_text())
    dep["context_window"] = 4_000_000
    (policy / "deployments/pool-llama-8b.yaml").write_text(yaml.safe_dump(dep))
    ref = repin(policy, "pool-llama-8b")
    for path in (policy / "evidence").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        if str(doc.get("deployment_ref", "")).startswith("pool-llama-8b@"):
            path.write_text(yaml.safe_dump({**doc, "deployment_ref": ref}))
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["envoy"]["extproc_message_timeout_ms"] = message_timeout_ms
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return policy


gw = module_stack("not-processed", slow_decisions, workers=1)
# Two workers and time to see which one decides: the other one, left alive, takes the access log.
two = module_stack("worker-dies", lambda tmp: slow_decisions(tmp, 5_000), workers=2)


def late_body(marker: str) -> dict[str, object]:
    """A prompt of ~3 MB of addresses to redact after its reservation: the decision outlasts the timeout."""
    content = marker + " write to a.b@example.com now" * 100_000
    return {"model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


def send_late(gw: Stack, marker: str, headers: dict[str, str] | None = None) -> Response:
    r = request(f"{gw.url}/v1/chat/completions", "POST", late_body(marker),
                {"authorization": f"Bearer {DEMO_KEYS['acme']}", **(headers or {})}, timeout=60)
    assert_contract_error(r, 503, "policy_unavailable")
    return r


def test_a_decision_envoy_gave_up_on_is_released_at_once(gw: Stack) -> None:
    marker = unique_marker("late")
    sent = time.monotonic()
    r = send_late(gw, marker)
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")  # waits up to 5 s: the lease is 10 s or more
    assert time.monotonic() - sent < 10
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released", entry
    assert entry["charged_micros"] == 0 and entry["reserved_micros"] > 0 and entry["attempts"] == [], entry
    arrived = [q for e in gw.engine_urls() for q in request(f"{e}/admin/requests").json()
               if marker in str(q.get("messages"))]
    assert arrived == []  # no upstream saw it


def test_a_refusal_decided_after_envoy_gave_up_says_not_processed(gw: Stack) -> None:
    """The worker goes on deciding after Envoy's 503 and refuses (the caller's 300 ms deadline ran out
    while it redacted). The caller never saw that refusal: the worker's own release and the access
    log's both write `not_processed`, so the ledger says what the caller got whichever is first."""
    r = send_late(gw, unique_marker("late-refusal"), {"x-llmgw-deadline-ms": "300"})
    entry = ledger_of(gw, r.headers["x-request-id"], "acme")
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released", entry
    assert entry["status"] == 503 and entry["charged_micros"] == 0 and entry["attempts"] == [], entry


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.serial
def test_a_worker_that_dies_after_reserving_leaves_nothing_charged(two: Stack) -> None:
    """The worker deciding a request writes its reservation, then dies (SIGKILL) while it redacts:
    Envoy answers the request itself, the surviving worker's access log releases the reservation at
    nothing, and the ledger says `not_processed` - not an ambiguous full charge when the lease expires.

    It holds when Envoy's settlement log reaches the surviving worker. On a loaded machine (the parallel
    tier, twice in four runs) Envoy sent the entry toward the worker just killed, before that worker
    left rotation, and it was lost: the hole invariant 4 names. So the kill is timed on a machine to
    itself, like the other faults timed against requests in flight."""
    store = redis.Redis.from_url(str(two.store_url))
    marker = unique_marker("dies")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(request_quietly, f"{two.url}/v1/chat/completions", "POST", late_body(marker),
                             {"authorization": f"Bearer {DEMO_KEYS['acme']}"}, timeout=60)
        deadline = time.monotonic() + 5
        while not store.zcard(leases_key("acme")):  # the reservation is written
            assert time.monotonic() < deadline, "no reservation"
            time.sleep(0.005)
        procs = [w.proc for w in two.extprocs if w.proc is not None]
        before = [cpu_ticks(p.pid) for p in procs]
        time.sleep(0.3)
        busy = max(range(len(procs)), key=lambda i: cpu_ticks(procs[i].pid) - before[i])  # the one redacting
        (rid,) = [r.decode() for r in store.zrange(leases_key("acme"), 0, -1)]
        procs[busy].kill()
        r = answer.result(timeout=30)
    assert r is not None and r.status >= 500, r
    entry = ledger_of(two, rid, "acme")  # waits up to 5 s: the lease is longer
    assert entry["termination"] == "not_processed" and entry["settlement"] == "released", entry
    assert entry["charged_micros"] == 0 and entry["reserved_micros"] > 0, entry
