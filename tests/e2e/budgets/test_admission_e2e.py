"""Admission control through the real Envoy, two ext_proc workers and one store (extproc/admission.py):
a saturated pool queues, then sheds with 429 `overloaded` and Retry-After (which the SDKs' own retries
honour, and each SDK reads as its rate-limit error); a waiter whose client goes away leaves at once; a
higher priority is admitted first whichever worker holds it; equal-weight tenants get equal shares while
one offers five times the other's load; a full pool sends a fallback plan's request to its next
candidate before any byte.

The pool here takes two requests at once (`max_in_flight: 2`). `chat-default` is the interactive class
(priority 10, 1.5 s queue TTL), `chat-patient` the same priority with 8 s, `chat-batch` priority 0 with
8 s. Requests hold their slot by carrying a marker the engines delay (the operator's fault API)."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis
import yaml
from google import genai
from google.genai import errors as genai_errors
from google.genai import types as genai_types

from extproc.store import ledger_entry, ledger_key, queue_keys, slots_key
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import Response, assert_contract_error, inject_fault, request, unique_marker
from tests.promtext import scrape, value

pytestmark = pytest.mark.e2e
POOL = "engine-pool"
INTERACTIVE_TTL_MS = 1500


def admission_policy(tmp: Path) -> Path:
    """The example policy; its pool takes two requests at once; a batch class below the interactive one."""
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    gw = yaml.safe_load((policy / "gateway.yaml").read_text())
    gw["pools"][POOL]["admission"] = {"max_in_flight": 2, "max_queued": 64}
    gw["request_classes"]["read_only_chat"].update(priority=10, queue_ttl_ms=INTERACTIVE_TTL_MS)
    gw["request_classes"]["batch_chat"] = {"priority": 0, "queue_ttl_ms": 8000}
    # The interactive priority with room to wait: the priority test's requests must outlast the holders
    # by a margin a loaded machine keeps (the 1.5 s class shed one there, its holders being 1.5 s too).
    gw["request_classes"]["patient_chat"] = {"priority": 10, "queue_ttl_ms": 8000}
    gw["tenants"]["globex"]["bulkhead"] = None
    (policy / "gateway.yaml").write_text(yaml.safe_dump(gw))
    for name, request_class in (("chat-batch", "batch_chat"), ("chat-patient", "patient_chat")):
        route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
        route.update(route_contract=name, request_class=request_class)
        (policy / f"routes/{name}.yaml").write_text(yaml.safe_dump(route))
    return policy


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("admission")
    s = start_stack(tmp / "state", admission_policy(tmp), workers=2, simulate_providers=True)
    yield s
    s.stop()


def store(gw: Stack) -> redis.Redis:
    return redis.Redis.from_url(str(gw.store_url), decode_responses=True)


def send(gw: Stack, content: str, route: str = "chat-default", tenant: str = "acme",
         timeout: float = 30) -> Response:
    return request(f"{gw.url}/v1/chat/completions", "POST",
                   {"model": route, "max_tokens": 4, "messages": [{"role": "user", "content": content}]},
                   {"authorization": f"Bearer {DEMO_KEYS[tenant]}"}, timeout=timeout)


def until(check: Callable[[], bool], within_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(0.02)


def hold_slots(gw: Stack, pool: ThreadPoolExecutor, hold_ms: int, n: int = 2) -> list[Any]:
    """n requests that keep their slots for hold_ms (the engines delay them), once the store holds them."""
    marker = inject_fault(gw.engine_urls(POOL), f"delay_ms={hold_ms}", count=n)
    held = [pool.submit(send, gw, marker) for _ in range(n)]
    until(lambda: store(gw).zcard(slots_key(POOL)) >= n, what=f"{n} slots held")
    return held


def idle(gw: Stack) -> None:
    """Nothing admitted and nobody waiting: the pool is back where a test starts."""
    until(lambda: store(gw).zcard(slots_key(POOL)) == 0 and store(gw).zcard(queue_keys(POOL)[0]) == 0,
          within_s=20, what="slots and queue empty")


def probe_entries(gw: Stack, tag: str, tenant: str, n: int, within_s: float = 5) -> list[dict[str, Any]]:
    """The ledger entries of the requests that carried `metadata.probe == tag`, once there are n."""
    found: list[dict[str, Any]] = []

    def ledgered() -> bool:
        found[:] = [e for _, f in store(gw).xrange(ledger_key(tenant))
                    if (e := ledger_entry(f)).get("metadata", {}).get("probe") == tag]
        return len(found) >= n

    until(ledgered, within_s=within_s, what=f"{n} ledger entries of {tag}")
    return found


def test_a_saturated_pool_sheds_after_the_class_queue_ttl_with_retry_after(gw: Stack) -> None:
    with ThreadPoolExecutor(4) as pool:
        held = hold_slots(gw, pool, 3500)
        assert value(scrape(gw.metrics_url.removesuffix("/metrics")), "llmgw_admission_slots", pool=POOL) == 2
        sent = time.monotonic()
        r = send(gw, "beyond the pool's bound")
        waited = time.monotonic() - sent
        assert_contract_error(r, 429, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        # It waited its class's queue TTL (not refused at once, not held until a slot freed).
        assert INTERACTIVE_TTL_MS / 1000 - 0.1 <= waited < 3.0, waited
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        assert entry["settlement"] == "released" and entry["charged_micros"] == 0 and entry["attempts"] == []
        shed, queued = entry["admission"].split(";")
        assert shed == "shed=queue_timeout" and int(queued.split("=")[1]) >= INTERACTIVE_TTL_MS - 100, entry
        assert all(f.result().status == 200 for f in held)
    idle(gw)
    # The decisions in the metrics, and each worker's bound in its status.
    metrics = scrape(gw.metrics_url.removesuffix("/metrics"))
    assert value(metrics, "llmgw_admission_total", target=POOL, outcome="shed_queue_timeout") >= 1
    assert value(metrics, "llmgw_admission_total", target=POOL, outcome="admitted") >= 2
    assert value(metrics, "llmgw_admission_queue_duration_seconds_count", target=POOL) >= 1
    assert all(request(u).json()["admission"].get(POOL, {}).get("limit") in (None, 2) for u in gw.status_urls)


def test_a_queued_request_is_admitted_when_a_slot_frees(gw: Stack) -> None:
    with ThreadPoolExecutor(4) as pool:
        held = hold_slots(gw, pool, 800)
        r = send(gw, "waits for a slot")
        assert r.status == 200, r.body
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        queued_ms = int(entry["admission"].removeprefix("queued_ms="))
        assert 100 < queued_ms < INTERACTIVE_TTL_MS, entry
        assert entry["settlement"] != "released" and entry["charged_micros"] > 0
        assert all(f.result().status == 200 for f in held)
    idle(gw)


def test_a_waiter_whose_client_goes_away_leaves_the_queue_at_once(gw: Stack) -> None:
    tag = unique_marker("gone")
    with ThreadPoolExecutor(4) as pool:
        held = hold_slots(gw, pool, 4000)
        url = urllib.parse.urlsplit(gw.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
        body = {"model": "chat-batch", "max_tokens": 4, "metadata": {"probe": tag},
                "messages": [{"role": "user", "content": "will not wait"}]}
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                      {"authorization": f"Bearer {DEMO_KEYS['acme']}", "content-type": "application/json"})
        until(lambda: store(gw).zcard(queue_keys(POOL)[0]) == 1, what="the request waiting")
        conn.close()  # the client goes away while it waits
        gone = time.monotonic()
        until(lambda: store(gw).zcard(queue_keys(POOL)[0]) == 0, within_s=1.0, what="the waiter gone")
        assert time.monotonic() - gone < 1.0
        # Its reservation is released at once (not left to its lease), and the ledger says why.
        (entry,) = probe_entries(gw, tag, "acme", 1, within_s=3)
        assert entry["termination"] == "cancelled" and entry["settlement"] == "released", entry
        assert entry["charged_micros"] == 0 and entry["attempts"] == []
        assert all(f.result().status == 200 for f in held)
    idle(gw)  # it holds no slot: the pool is empty once the holders are done


def test_a_higher_priority_is_admitted_first_whichever_worker_holds_it(gw: Stack) -> None:
    marker = inject_fault(gw.engine_urls(POOL), "delay_ms=700", count=5)
    with ThreadPoolExecutor(8) as pool:
        held = hold_slots(gw, pool, 1500)
        batch = [pool.submit(send, gw, marker, "chat-batch", "globex") for _ in range(3)]
        until(lambda: store(gw).zcard(queue_keys(POOL)[0]) == 3, what="three batch requests waiting")
        interactive = [pool.submit(send, gw, marker, "chat-patient", "acme") for _ in range(2)]
        waits = {}
        for kind, futures, tenant in (("batch", batch, "globex"), ("interactive", interactive, "acme")):
            for f in futures:
                r = f.result()
                assert r.status == 200, r.body
                entry = ledger_of(gw, r.headers["x-request-id"], tenant)
                waits.setdefault(kind, []).append(int(entry["admission"].removeprefix("queued_ms=")))
        assert all(f.result().status == 200 for f in held)
    # The batch requests came first and waited longer: both interactive ones went in before any of them.
    assert max(waits["interactive"]) + 400 < min(waits["batch"]), waits
    idle(gw)


def test_equal_weight_tenants_share_a_saturated_pool_while_one_offers_five_times_more(gw: Stack) -> None:
    marker = inject_fault(gw.engine_urls(POOL), "delay_ms=250", count=10_000)
    served: Counter[str] = Counter()
    shed: Counter[str] = Counter()
    stop = threading.Event()
    lock = threading.Lock()

    def client(tenant: str) -> None:
        while not stop.is_set():
            r = send(gw, marker, "chat-batch", tenant)
            with lock:
                (served if r.status == 200 else shed)[tenant] += 1
            if r.status != 200:
                assert_contract_error(r, 429, "overloaded")

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(client, "acme") for _ in range(10)] + [pool.submit(client, "globex") for _ in range(2)]
        time.sleep(8)
        stop.set()
        for f in futures:
            f.result()
    share = served["globex"] / (served["acme"] + served["globex"])
    jain = (served["acme"] + served["globex"]) ** 2 / (2 * (served["acme"] ** 2 + served["globex"] ** 2))
    print(f"fairness: served {dict(served)}, shed {dict(shed)}, globex share {share:.3f}, Jain {jain:.3f}")
    # First come, first served would give globex 2 of every 12 slots (share 0.17, Jain 0.66).
    assert 0.4 <= share <= 0.6 and jain >= 0.95, (served, shed, share, jain)
    idle(gw)


def test_a_full_pool_sends_a_fallback_plan_to_its_next_candidate(gw: Stack) -> None:
    with ThreadPoolExecutor(4) as pool:
        held = hold_slots(gw, pool, 2000)
        sent = time.monotonic()
        r = send(gw, "the pool is full", "chat-fallback")
        assert r.status == 200, r.body
        assert time.monotonic() - sent < 1.5  # no wait for the pool: the next candidate had room
        entry = ledger_of(gw, r.headers["x-request-id"], "acme")
        assert entry["admission"] == "skipped=pool-llama-8b:overloaded", entry
        assert [a["deployment"] for a in entry["attempts"]] == ["demo-anthropic"], entry
        assert all(f.result().status == 200 for f in held)
    idle(gw)


def test_a_slot_asked_beside_a_refused_reservation_goes_back(gw: Stack) -> None:
    """The first pool's slot is asked for in the reservation's write (stages/budget.py): when the
    reservation is refused (here a second request with an Idempotency-Key in flight), the slot it was
    granted goes back at once, not when its lease ends."""
    idle(gw)
    marker = inject_fault(gw.engine_urls(POOL), "delay_ms=2500", count=1)
    body = {"model": "chat-default", "max_tokens": 4, "messages": [{"role": "user", "content": marker}]}
    headers = {"authorization": f"Bearer {DEMO_KEYS['acme']}", "idempotency-key": marker}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(request, f"{gw.url}/v1/chat/completions", "POST", body, headers, timeout=30)
        until(lambda: store(gw).zcard(slots_key(POOL)) == 1, what="the first request holds its slot")
        holder = store(gw).zrange(slots_key(POOL), 0, -1)
        second = request(f"{gw.url}/v1/chat/completions", "POST", body, headers, timeout=30)
        assert_contract_error(second, 409, "idempotency_conflict")
        # Given back in the background, right after the refusal: well within the first one's delay.
        until(lambda: store(gw).zrange(slots_key(POOL), 0, -1) == holder, within_s=1.0,
              what="only the first request's slot held")
        time.sleep(0.2)
        assert store(gw).zrange(slots_key(POOL), 0, -1) == holder
        assert first.result().status == 200
    idle(gw)


def test_the_openai_sdks_default_retries_honour_retry_after_and_take_the_freed_slot(gw: Stack) -> None:
    """A caller of the OpenAI SDK with its defaults (two retries, the server's Retry-After honoured): its
    request is shed after its class's queue TTL, the SDK waits what Retry-After says and asks again, and
    the retry is admitted once the slots have freed. The ledger holds each: a shed one released at
    nothing, the served one charged."""
    tag = unique_marker("sdk-retry")
    wire: list[tuple[float, int, str]] = []  # what the SDK sent and got: (when, status or 0 for a request, retry-after)
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=DEMO_KEYS["acme"], http_client=openai.DefaultHttpxClient(
        event_hooks={"request": [lambda _: wire.append((time.monotonic(), 0, ""))],
                     "response": [lambda r: wire.append((time.monotonic(), r.status_code,
                                                         r.headers.get("retry-after", "")))]}))
    with ThreadPoolExecutor(4) as pool:
        held = hold_slots(gw, pool, 2500)
        raw = client.chat.completions.with_raw_response.create(
            model="chat-default", max_tokens=4, metadata={"probe": tag},
            messages=[{"role": "user", "content": "retried by the SDK"}])
        assert all(f.result().status == 200 for f in held)
    assert raw.http_response.status_code == 200 and raw.parse().choices[0].message.content
    assert raw.retries_taken >= 1  # it was shed first: the SDK's own retry served it
    (sent, _, _), (shed_at, status, retry_after) = wire[:2]
    assert status == 429 and shed_at - sent >= INTERACTIVE_TTL_MS / 1000 - 0.1  # after its class's queue TTL
    retried_at = wire[2][0]
    assert retried_at - shed_at >= int(retry_after) - 0.05, wire  # the SDK waited what Retry-After said
    entries = probe_entries(gw, tag, "acme", raw.retries_taken + 1)
    shed = [e for e in entries if str(e.get("admission", "")).startswith("shed=queue_timeout")]
    served = [e for e in entries if e["status"] == 200]
    assert len(shed) == raw.retries_taken and len(served) == 1, entries
    assert all(e["status"] == 429 and e["settlement"] == "released" and e["charged_micros"] == 0 for e in shed)
    assert served[0]["charged_micros"] > 0
    idle(gw)


def test_each_sdk_reads_a_shed_as_its_own_rate_limit_error_with_retry_after(gw: Stack) -> None:
    """The shed in each SDK's own terms (retries off, to see the first answer): OpenAI's and Anthropic's
    RateLimitError and google-genai's RESOURCE_EXHAUSTED, each with the contract's code `overloaded`
    and a Retry-After their retries honour."""
    oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)
    an = anthropic.Anthropic(base_url=gw.url, api_key=DEMO_KEYS["acme"], max_retries=0)
    gg = genai.Client(api_key=DEMO_KEYS["acme"], http_options=genai_types.HttpOptions(
        base_url=gw.url, retry_options=genai_types.HttpRetryOptions(attempts=1)))
    ask = [{"role": "user", "content": "shed in the caller's shape"}]
    calls: dict[str, Callable[[], Any]] = {
        "openai": lambda: oa.chat.completions.create(model="chat-default", max_tokens=4, messages=ask),
        "anthropic": lambda: an.messages.create(model="chat-default", max_tokens=4, messages=ask),
        "genai": lambda: gg.models.generate_content(model="chat-default", contents="shed in the caller's shape"),
    }

    def raised(call: Callable[[], Any]) -> BaseException | None:
        try:
            call()
        except Exception as e:  # the SDK's exception is what the test reads
            return e
        return None

    with ThreadPoolExecutor(6) as pool:
        held = hold_slots(gw, pool, 4000)
        errors = {name: pool.submit(raised, call) for name, call in calls.items()}
        got = {name: f.result() for name, f in errors.items()}
        assert all(f.result().status == 200 for f in held)
    o, a, g = got["openai"], got["anthropic"], got["genai"]
    assert isinstance(o, openai.RateLimitError) and o.code == "overloaded", repr(o)
    assert isinstance(a, anthropic.RateLimitError) and a.body["error"]["code"] == "overloaded", repr(a)
    assert isinstance(g, genai_errors.ClientError) and (g.code, g.status) == (429, "RESOURCE_EXHAUSTED"), repr(g)
    assert g.details["error"]["details"][0]["reason"] == "overloaded"
    assert int(o.response.headers["retry-after"]) >= 1 and int(a.response.headers["retry-after"]) >= 1
    assert int(g.response.headers["retry-after"]) >= 1
    idle(gw)
