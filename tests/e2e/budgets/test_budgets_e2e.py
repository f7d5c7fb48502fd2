"""Budgets, bulkheads, idempotency, the ledger and a dead store, through the real processes: Envoy,
ext_proc workers sharing one Valkey, simulated engines. Invariants 3, 4, 8 and 11."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import http.client
import json
import shutil
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from extproc.chat import prompt_bytes
from extproc.store import budget_key, ledger_entry, ledger_key
from llmgw.local.procs import Child, free_port, tcp_open, valkey_binary, wait_until
from llmgw.local.stack import Stack
from llmgw.ops.store import store_client
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack, start_stack
from tests.e2e.routing.test_e2e_served_path import clear_engine_logs, engine_log
from tests.helpers import assert_contract_error, chat_body, inject_fault, request
from tests.promtext import store_rounds

pytestmark = pytest.mark.e2e
KEYS = {t: f"sk-test-{t}-0123456789" for t in ("burst", "flood", "steady", "quota")}
N = 37  # the burst tenant's budget holds exactly this many reservations


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bound(body: dict[str, Any]) -> int:
    """The reservation bound ext_proc computes (invariant 3), from the example deployment."""
    dep = yaml.safe_load((POLICY / "deployments/pool-llama-8b.yaml").read_text())
    return prompt_bytes(body) + dep.get("template_allowance_tokens", 8) * len(body["messages"]) + body["max_tokens"]


BURST_MARKER = "FAULT-burst-delay"  # the engines hold these 3 s (a queued fault; see the test)
BURST_BODY = chat_body(max_tokens=4, content=f"burst {BURST_MARKER}")


def make_policy(root: Path, store_over: dict[str, Any] | None = None, **route_over: Any) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    for t, key in KEYS.items():
        gw["tenants"][t] = {"default_data_class": "public", "allowed_data_classes": ["public"],
                            "api_keys": [{"id": f"{t}-1", "sha256": _sha(key)}]}
    gw["tenants"]["flood"]["bulkhead"] = {"max_in_flight": 4}
    gw["budgets"].append({"name": "burst-total", "tenant": "burst", "window": "total",
                          "limit_tokens": N * bound(BURST_BODY)})
    gw["quotas"].append({"name": "quota-rpm", "tenant": "quota", "requests_per_minute": 3})
    gw["store"]["lease_grace_ms"] = 500
    gw["store"].update(store_over or {})
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    if route_over:
        route = yaml.safe_load((dst / "routes/chat-default.yaml").read_text())
        route.update(route_over)
        (dst / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    return dst


gw = module_stack("budgets", make_policy, workers=2)
# The same with every worker admitting from slices (extproc/slices.py) where a request may be.
SLICES = {"slice_requests": 16, "slice_ms": 500, "slice_commit_ms": 20}
gw_sliced = module_stack("budgets-sliced", functools.partial(make_policy, store_over=SLICES), workers=2)


def store(s: Stack) -> Any:
    return redis.Redis.from_url(s.store_url, decode_responses=True)


def ledger(s: Stack, tenant: str) -> list[dict[str, Any]]:
    return [ledger_entry(f) for _, f in store(s).xrange(ledger_key(tenant))]


def chat(s: Stack, tenant: str, body: dict[str, Any] | None = None, **headers: str) -> Any:
    return request(f"{s.url}/v1/chat/completions", "POST", body or chat_body(max_tokens=4),
                   headers={"authorization": f"Bearer {KEYS.get(tenant) or DEMO_KEYS[tenant]}", **headers},
                   timeout=30)


@pytest.mark.serial  # a 500-request burst: refusals must all be the budget's, not a loaded machine's timeouts
def test_500_concurrent_never_overshoot_the_budget_across_two_workers(gw: Stack) -> None:
    burst_holds_the_budget([gw], 500, str(gw.store_url))


@pytest.mark.serial
def test_500_concurrent_admitted_from_slices_never_overshoot_the_budget(gw_sliced: Stack) -> None:
    """The same burst with both workers admitting from slices: the same invariants, and the slices did
    admit (the budget's first requests took no store round trip each)."""
    burst_holds_the_budget([gw_sliced], 500, str(gw_sliced.store_url))
    records = ledger(gw_sliced, "burst")
    # A slice's admission is written behind, each one a reservation of its own: its ledger entry is an
    # ordinary one; what shows that slices admitted is the store's count of the scripts that took them.
    assert store_rounds(gw_sliced.metrics_url, "take_slice") >= 1, "no slice was taken"
    assert len({r["request_id"] for r in records}) == len(records) == 500


def burst_holds_the_budget(stacks: list[Stack], per_stack: int, store_url: str) -> None:
    """`per_stack` requests of the burst tenant through each stack at once: the budget's reserved plus
    settled tokens, sampled throughout, never pass its ceiling (invariant 3); one ledger entry each.
    (tests/e2e/operations/test_cluster_e2e.py: two stacks on one Valkey Cluster.)"""
    ceiling = N * bound(BURST_BODY)
    key = budget_key("burst", "burst-total", "total")
    r = store_client(store_url)
    samples: list[int] = []
    stop = threading.Event()
    total = per_stack * len(stacks)

    def sample() -> None:
        while not stop.is_set():
            h = r.hgetall(key)
            samples.append(int(h.get("settled_tokens", 0)) + int(h.get("reserved_tokens", 0)))
            time.sleep(0.002)

    async def burst() -> list[tuple[int, dict[str, Any]]]:
        # The engines hold each admitted request 3 s, so all reserve while the first are in flight.
        headers = {"authorization": f"Bearer {KEYS['burst']}"}
        for s in stacks:
            inject_fault(s.engine_urls(), "delay_ms=3000", count=per_stack, marker=BURST_MARKER)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(s: Stack) -> tuple[int, dict[str, Any]]:
                async with session.post(f"{s.url}/v1/chat/completions", json=BURST_BODY, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    return resp.status, await resp.json(content_type=None)
            return await asyncio.gather(*(one(s) for _ in range(per_stack) for s in stacks))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = asyncio.run(burst())
    finally:
        time.sleep(1.0)  # settlements and refusal records land after the replies
        stop.set()
        sampler.join()
    admitted = [b for s, b in results if s == 200]
    refused = [b for s, b in results if s != 200]
    assert 0 < len(admitted) <= N, len(admitted)
    assert all(b["error"]["code"] == "budget_exhausted" for b in refused), {b["error"]["code"] for b in refused}
    assert len(samples) > 50 and max(samples) <= ceiling, (max(samples), ceiling)
    h = r.hgetall(key)
    assert int(h["reserved_tokens"]) == 0
    records = [ledger_entry(f) for _, f in r.xrange(ledger_key("burst"))]
    assert len(records) == total  # one per authenticated request, admitted or refused, whichever stack
    assert int(h["settled_tokens"]) == sum(x.get("charged_tokens", 0) for x in records)
    assert sum(1 for x in records if x["settlement"] == "actual") == len(admitted)


def test_budget_exhausted_and_quota_are_429_in_contract_shape(gw: Stack) -> None:
    for _ in range(3):
        assert chat(gw, "quota").status == 200
    r = chat(gw, "quota")
    assert_contract_error(r, 429, "rate_limited")
    assert int(r.headers["retry-after"]) >= 1


def test_ledger_export_writes_each_record_once(gw: Stack, tmp_path: Path) -> None:
    import subprocess
    import sys

    for _ in range(3):
        assert chat(gw, "steady").status == 200
    time.sleep(0.5)
    out = tmp_path / "ledger.jsonl"
    args = [sys.executable, "-m", "llmgw", "ledger", "export", "--config", str(gw.snapshot.directory),
            "--store-url", str(gw.store_url), "--tenant", "steady", "-o", str(out)]
    first = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(ledger(gw, "steady")) >= 3
    assert all(r["tenant"] == "steady" and "messages" not in r for r in records)
    again = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "exported 0 record(s)" in again.stderr  # acknowledged: never twice
    assert len(out.read_text().splitlines()) == len(records)


def test_idempotency_in_flight_replay_and_reuse(gw: Stack) -> None:
    idempotency_holds(gw, gw)


def idempotency_holds(first_gw: Stack, then: Stack) -> None:
    """A key taken through `first_gw`: 409 through `then` while in flight, the answer replayed there
    afterwards, 422 for another body; one upstream call in all (two stacks:
    tests/e2e/operations/test_cluster_e2e.py)."""
    stacks = [first_gw] if first_gw is then else [first_gw, then]
    for s in stacks:
        clear_engine_logs(s)
    marker = inject_fault(first_gw.engine_urls(), "delay_ms=1500")
    body = chat_body(max_tokens=4, content=f"idempotent hello {marker}")
    key = f"idem-{time.time_ns()}"
    first: list[Any] = []
    t = threading.Thread(target=lambda: first.append(chat(first_gw, "steady", body, **{"idempotency-key": key})))
    t.start()
    time.sleep(0.4)
    assert_contract_error(chat(then, "steady", body, **{"idempotency-key": key}), 409, "idempotency_conflict")
    t.join(10)
    assert first[0].status == 200
    time.sleep(0.3)  # the meter records the outcome when the response ends
    replay = chat(then, "steady", body, **{"idempotency-key": key})
    assert replay.status == 200 and replay.headers.get("x-llmgw-idempotent-replay") == "true"
    assert replay.json() == first[0].json()
    other = chat_body(max_tokens=4, content="a different body")
    assert_contract_error(chat(then, "steady", other, **{"idempotency-key": key}), 422, "idempotency_key_reused")
    upstream = [e for s in stacks for e in engine_log(s) if marker in json.dumps(e["messages"])]
    assert len(upstream) == 1  # never a second upstream call


def _p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(len(xs) * 0.9) - 1)]


@pytest.mark.serial  # compares latencies
def test_a_tenant_at_its_bulkhead_cap_does_not_slow_another(tmp_path: Path) -> None:
    """Engines in real time here (time scale 1): at 20x, simulating the engines' steps would itself
    compete for this machine's 2 cores and measure the simulator, not the gateway. B's requests are
    16 tokens: joining an engine busy with A's batch costs up to one decode step (~7 ms), as it does
    in vLLM; that is the engines' physics, not the gateway's isolation."""
    s = start_stack(tmp_path / "state", make_policy(tmp_path), time_scale=1.0)

    def steady_run(seconds: float) -> tuple[list[float], list[int]]:
        lat, codes = [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            codes.append(chat(s, "steady", chat_body(max_tokens=16, ignore_eos=True)).status)
            lat.append((time.perf_counter() - t0) * 1000)
        return lat, codes

    steady_run(1.0)  # warm
    solo, solo_codes = steady_run(7.0)
    stop = threading.Event()
    flood_codes: list[int] = []

    def flood() -> None:
        # Long generations, as LLM traffic is: A keeps its 4 permits busy on the same engines as B.
        while not stop.is_set():
            r = chat(s, "flood", chat_body(max_tokens=300, ignore_eos=True))
            flood_codes.append(r.status)
            if r.status == 429:  # a well-behaved client honours retry-after
                stop.wait(float(r.headers.get("retry-after", "1")))

    threads = [threading.Thread(target=flood) for _ in range(8)]  # twice the cap of 4
    for th in threads:
        th.start()
    try:
        time.sleep(1.0)
        loaded, loaded_codes = steady_run(7.0)
    finally:
        stop.set()
        for th in threads:
            th.join(15)
        s.stop()
    assert set(solo_codes) == {200} and set(loaded_codes) == {200}  # B never sees a 429
    assert 429 in flood_codes and 200 in flood_codes  # A really was at its cap
    # p90: about 40 requests a window, so their p99 is the second slowest, one scheduling hiccup of a
    # 2-core machine (x1.23 once, beside a `make up`, with the p50 at x1.08).
    ratio = _p90(loaded) / _p90(solo)
    print(f"\nsteady tenant p90: solo {_p90(solo):.2f} ms, beside the flood {_p90(loaded):.2f} ms "
          f"(x{ratio:.2f}); p50 {statistics.median(solo):.2f} / {statistics.median(loaded):.2f} ms; "
          f"flood: {flood_codes.count(200)} served, {flood_codes.count(429)} refused")
    assert ratio <= 1.2, ratio


@pytest.mark.serial  # a kill timed against a stream in flight
def test_sigkill_extproc_mid_stream_loses_nothing(tmp_path: Path) -> None:
    """A stream passes Envoy's native filters only, so the worker that admitted it may die: the stream
    runs on, and its end (here Envoy cutting a stall at max_stream_ms) settles from the access log at
    the restarted worker, charged for what was generated. (A stream whose settlement is lost
    altogether is charged in full when its lease expires: test_hardening_e2e.)"""
    # The stream must outlast the worker's restart: an access-log entry Envoy sends while no worker
    # listens is lost (the lease then charges in full, test_hardening_e2e), and a restart on a loaded
    # 2-core CI machine took longer than 1.5 s once.
    max_stream_ms = 8000
    s = start_stack(tmp_path / "state", make_policy(tmp_path, deadline_ms=1500, max_stream_ms=max_stream_ms))
    try:
        host, port = s.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        marker = inject_fault(s.engine_urls(), "stall_after=2")
        sent_at = time.monotonic()
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(content=marker, max_tokens=50, stream=True)),
                     {"authorization": f"Bearer {KEYS['steady']}", "content-type": "application/json"})
        resp = conn.getresponse()
        rid = resp.getheader("x-request-id")
        assert resp.status == 200 and rid
        assert resp.read(5) == b"data:"  # the stream is running
        # Admitted from the worker's slice, its reservation is written behind (within slice_commit_ms).
        written_by = time.monotonic() + 2
        while not (held := store(s).hgetall(f"llmgw:{{steady}}:res:{rid}")) and time.monotonic() < written_by:
            time.sleep(0.01)
        assert held, "no reservation in flight"
        (ext,) = s.extprocs
        ext.signal(signal.SIGKILL)
        ext.proc.wait(5)
        restarted = Child(ext.name, ext.argv, ext.log_path, env=ext.env, probe=ext.probe).start()  # a supervisor
        s.extprocs[0] = restarted
        assert ext.probe is not None
        wait_until(ext.probe, 30, "the restarted worker", restarted)
        restart_s = time.monotonic() - sent_at
        # Otherwise this test proves nothing about the stream outliving its worker: say so, not flake.
        assert restart_s < max_stream_ms / 1000 - 1, f"the worker took {restart_s:.1f} s to come back"
        deadline = time.monotonic() + 15
        mine: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not mine:
            mine = [x for x in ledger(s, "steady") if x["request_id"] == rid]
            time.sleep(0.2)
        assert mine, "the stream was never settled"
        time.sleep(2.0)  # nothing settles it twice
        (rec,) = [x for x in ledger(s, "steady") if x["request_id"] == rid]
        assert rec["termination"] == "stream_interrupted" and rec["settlement"] == "partial", rec
        # The prompt's bound and the two chunks generated before the stall, within the reservation.
        prompt_bound = json.loads(held["hint"])["p"]
        assert rec["usage"] == {"prompt_tokens": prompt_bound, "completion_tokens": 2}, rec
        assert rec["charged_tokens"] == prompt_bound + 2 < int(held["tokens"])
        conn.close()
    finally:
        s.stop()


def test_valkey_restart_keeps_budgets_and_ledger_and_a_dead_store_fails_fast(tmp_path: Path) -> None:
    s = start_stack(tmp_path / "state", make_policy(tmp_path))
    try:
        for _ in range(3):
            assert chat(s, "acme").status == 200
        time.sleep(1.5)  # settled, and the append-only file synced (everysec)
        key = next(iter(store(s).scan_iter("llmgw:{acme}:budget:*")))
        before = (store(s).hgetall(key), len(ledger(s, "acme")))
        assert before[1] == 3 and int(before[0]["settled_micros"]) > 0
        assert s.valkey is not None
        s.valkey.stop()  # SIGTERM: Valkey flushes and exits
        s.valkey = Child(s.valkey.name, s.valkey.argv, s.valkey.log_path).start()
        vport = int(s.store_url.rsplit(":", 1)[1].split("/")[0])  # type: ignore[union-attr]
        wait_until(lambda: tcp_open("127.0.0.1", vport), 20, "valkey", s.valkey)
        time.sleep(0.5)  # loading the append-only file
        assert (store(s).hgetall(key), len(ledger(s, "acme"))) == before
        assert chat(s, "acme").status == 200  # ext_proc reconnects

        s.valkey.signal(signal.SIGKILL)
        s.valkey.proc.wait(5)
        # A slice the worker holds was metered when it was taken: it may admit until the worker's next
        # write of its admissions fails (record 0033), and then nothing more is admitted.
        killed, served = time.monotonic(), 0
        while True:
            t0 = time.monotonic()
            r = chat(s, "acme")
            elapsed = time.monotonic() - t0
            if r.status != 200:
                break
            served += 1
            assert time.monotonic() - killed < 1.0, f"{served} served in the second after the store died"
        assert_contract_error(r, 503, "policy_unavailable")
        assert elapsed < 1.0, elapsed  # fail closed, fast: never hang, never admit unmetered
    finally:
        s.stop()


def test_a_store_down_from_the_start_refuses_fast_until_it_comes_up(tmp_path: Path) -> None:
    policy = make_policy(tmp_path)
    vport = free_port()
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["store"]["url"] = f"redis://127.0.0.1:{vport}/0"  # nothing listens there yet
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    s = start_stack(tmp_path / "state", policy, with_valkey=False)
    valkey: Child | None = None
    try:
        t0 = time.monotonic()
        r = chat(s, "acme")
        assert_contract_error(r, 503, "policy_unavailable")
        assert time.monotonic() - t0 < 1.0
        assert "store not reachable at start" in "".join(c.tail() for c in s.extprocs)
        valkey = Child("valkey", [str(valkey_binary()), "--port", str(vport), "--bind", "127.0.0.1", "--save", ""],
                       tmp_path / "valkey.log").start()
        wait_until(lambda: tcp_open("127.0.0.1", vport), 20, "valkey", valkey)
        assert chat(s, "acme").status == 200  # connects when the store is there; scripts loaded then
    finally:
        s.stop()
        if valkey is not None:
            valkey.stop()


@pytest.mark.serial  # workers killed and restarted, timed against their slices' expiry
def test_workers_killed_holding_slices_give_back_at_expiry_and_the_ledger_stays_exact(tmp_path: Path) -> None:
    """Both workers admit from slices and are SIGKILLed holding them, most of each unused: every answer
    already has its one ledger entry (each admission reached the store before Envoy could dispatch
    it), and what the slices held unused is given back when they expire - by the restarted workers'
    sweeper - so the budget holds nothing and its settled total is the ledger's."""
    policy = make_policy(tmp_path, store_over={"slice_requests": 16, "slice_ms": 3000}, deadline_ms=2000,
                         max_stream_ms=1000)
    gw_doc = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw_doc["budgets"].append({"name": "steady-total", "tenant": "steady", "window": "total", "limit_tokens": 10**7})
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw_doc))
    s = start_stack(tmp_path / "state", policy, workers=2)
    try:
        key = budget_key("steady", "steady-total", "total")
        rids = []
        for _ in range(6):
            resp = chat(s, "steady")
            assert resp.status == 200, resp.body
            rids.append(resp.headers["x-request-id"])
        for rid in rids:
            ledger_of(s, rid, "steady")  # settled, each once
        held = {k: int(v) for k, v in store(s).hgetall(key).items()}
        assert held["reserved_tokens"] > 0, held  # what the slices hold unused
        for i, ext in enumerate(s.extprocs):
            ext.signal(signal.SIGKILL)
            ext.proc.wait(5)
            s.extprocs[i] = Child(ext.name, ext.argv, ext.log_path, env=ext.env, probe=ext.probe).start()
        for ext in s.extprocs:
            assert ext.probe is not None
            wait_until(ext.probe, 30, "the restarted worker", ext)
        # The slices expire 3 s (admitting) + 2 s (deadline) + 0.5 s (grace) after they were taken; the
        # sweeper runs every second.
        deadline = time.monotonic() + 20
        while int(store(s).hget(key, "reserved_tokens") or 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        after = {k: int(v) for k, v in store(s).hgetall(key).items()}
        assert after["reserved_tokens"] == 0 and after["reserved_micros"] == 0, after
        entries = ledger(s, "steady")
        assert sorted(e["request_id"] for e in entries) == sorted(rids)  # one each, nothing added
        assert all(e["settlement"] == "actual" and e["route"] == "chat-default" for e in entries)
        assert after["settled_tokens"] == sum(e["charged_tokens"] for e in entries) > 0
        assert store(s).zcard("llmgw:{steady}:leases") == 0
    finally:
        s.stop()
