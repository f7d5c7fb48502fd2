"""Fallback before the first byte (invariant 7), through real Envoy: a route of two candidates on two
simulated pools, the second a different model (a model fallback) that may serve only public and
internal data. Two ext_proc workers, so an attempt's filter and the request's decision may run on
different processes; the attempts meet in the store.

- Candidate 1 answers 503 before any header: candidate 2 serves, addressed by its own model name;
  `x-llmgw-attempts: 2`, `x-llmgw-deployment` names candidate 2, the ledger lists both attempts and
  prices the answer at candidate 2's prices.
- A confidential request never reaches candidate 2, not even when candidate 1 fails.
- A stream whose first byte is later than its per-try limit falls back to candidate 2.
- The attempt that falls back goes to the engine of candidate 2's pool that the picker ranks first.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from extproc.picker import parse_load
from llmgw.bench.policy import add_candidate
from llmgw.local.procs import free_port, wait_until
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, module_stack, stamp_evidence, start_stack
from tests.conftest import ledger_of as conftest_ledger_of
from tests.helpers import assert_contract_error, chat_body, request, request_quietly

pytestmark = pytest.mark.e2e
KEY = DEMO_KEYS["acme"]
POOL_CREDENTIAL = "pool-credential-not-for-the-backup"
BACKUP = "backup-qwen-7b"
BACKUP_MODEL = "Qwen/Qwen2.5-7B-Instruct"
BACKUP_PRICES = {"version": "2026-11-b", "currency": "USD", "input_per_mtok": 400000,
                 "cached_input_per_mtok": 200000, "output_per_mtok": 1600000}


def fallback_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    # Free ports, never fixed ones: the suite runs beside an operator's `make up` (issue 43).
    add_candidate(dst, BACKUP, "backup-pool", f"127.0.0.1:{free_port()}", {"model_digest": "sha256:" + "ab" * 32},
                  {"data_classes": ["public", "internal"]}, served_model=BACKUP_MODEL, context_window=32768,
                  data_classes=["public", "internal"], prices=BACKUP_PRICES, route_name="chat-default")
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["pools"]["backup-pool"]["endpoints"].append(f"127.0.0.1:{free_port()}")  # two engines: the picker chooses
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    # Candidate 1 takes a credential of its own (a hosted provider would); candidate 2 none.
    (dst / "pool.key").write_text(POOL_CREDENTIAL)
    first_dep = yaml.safe_load((dst / "deployments/pool-llama-8b.yaml").read_text())
    first_dep["credential_ref"] = "file:pool.key"
    (dst / "deployments/pool-llama-8b.yaml").write_text(yaml.safe_dump(first_dep))
    route = yaml.safe_load((dst / "routes/chat-default.yaml").read_text())
    route["retry"] = {"attempts": 1, "eligible_failures": ["connect_before_send", "unavailable", "no_first_byte"],
                      "requires": "read_only_or_idempotency_key"}
    (dst / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    stamp_evidence(dst, "pool-llama-8b", BACKUP)  # under the route's new retry policy
    return dst


gw = module_stack("fallback", fallback_policy, workers=2)


def fault_all(stack: Stack, pool: str, fault: str | None) -> None:
    """Every engine of the pool answers its next request with this fault (None: clear faults)."""
    for url in stack.engine_urls(pool):
        request(f"{url}/admin/faults", "DELETE")
        if fault:
            request(f"{url}/admin/faults", "POST", {"fault": fault, "count": 1})


@pytest.fixture(autouse=True)
def clean_engines(gw: Stack) -> Iterator[None]:
    for url in gw.engine_urls():
        request(f"{url}/admin/requests", "DELETE")
        request(f"{url}/admin/faults", "DELETE")
    yield
    for url in gw.engine_urls():
        request(f"{url}/admin/faults", "DELETE")


def received(stack: Stack, pool: str) -> list[dict[str, Any]]:
    return [e for url in stack.engine_urls(pool) for e in request(f"{url}/admin/requests").json()]


def ledger_of(stack: Stack, rid: str) -> dict[str, Any]:
    return conftest_ledger_of(stack, rid, "acme")


def chat(stack: Stack, content: str, **headers: str) -> Any:
    return request(f"{stack.url}/v1/chat/completions", "POST", chat_body(content=content, max_tokens=4),
                   headers={"authorization": f"Bearer {KEY}", **headers}, timeout=30)


def running(engine: str) -> float:
    page = request(f"{engine}/metrics").body.decode()
    return parse_load(page, at=0.0).running


def test_the_fallback_attempt_goes_to_the_engine_the_picker_ranks_first(gw: Stack) -> None:
    busy, idle = gw.engine_urls("backup-pool")
    # Load one of candidate 2's engines directly: the picker sees it in the engine's metrics, Envoy's
    # own balancer (least request, the policy's fallback) does not. `ignore_eos`: each load runs to
    # its max_tokens (nearly the engine's whole window: long enough to outlast the six requests below
    # on a loaded machine; 4,000 tokens once ended before the last of them), not to a sampled length.
    load = chat_body(BACKUP_MODEL, max_tokens=8000, stream=True, ignore_eos=True)
    threads = [threading.Thread(target=request_quietly, args=(f"{busy}/v1/chat/completions", "POST", load),
                                kwargs={"timeout": 30}, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    # The premise, as the picker reads it: three running on one engine, none on the other (without it,
    # both would tie and the order would come down to the addresses).
    wait_until(lambda: running(busy) == 3, 10, "load on the busy engine")
    assert running(idle) == 0
    # Two scrapes of the engines after the load began (one worker scrapes for all): the picker has seen
    # it. A fixed 0.3 s was not always enough on a loaded machine, where a scrape can take longer.
    scrapes = lambda: sum(request(u).json()["metrics_scrapes"] for u in gw.status_urls)  # noqa: E731
    seen = scrapes()
    wait_until(lambda: scrapes() >= seen + 2, 10, "two scrapes with the load")
    marker = uuid.uuid4().hex
    for i in range(6):
        fault_all(gw, "engine-pool", "status=503")
        r = chat(gw, f"{marker} {i}")
        assert r.status == 200 and r.headers["x-llmgw-deployment"] == BACKUP, r.body
    assert running(busy) == 3, "the load ended before the requests did: the premise no longer held"
    served = {url: sum(marker in json.dumps(e["messages"]) for e in request(f"{url}/admin/requests").json())
              for url in (busy, idle)}
    assert served == {busy: 0, idle: 6}, served
    for t in threads:
        t.join()


def test_candidate_1_answering_503_falls_back_to_candidate_2(gw: Stack) -> None:
    fault_all(gw, "engine-pool", "status=503")
    r = chat(gw, "fall back please")
    assert r.status == 200, r.body
    assert r.headers["x-llmgw-attempts"] == "2"
    assert r.headers["x-llmgw-deployment"] == BACKUP
    first, second = received(gw, "engine-pool"), received(gw, "backup-pool")
    assert [(e["status"], e["model"]) for e in first] == [(503, "meta-llama/Llama-3.1-8B-Instruct")]
    # The attempt filter addressed candidate 2 by its own model; candidate 1's credential went to
    # candidate 1 only (the retry reuses the request's headers), the caller's to neither.
    assert [(e["status"], e["model"]) for e in second] == [(200, BACKUP_MODEL)]
    assert first[0]["authorization_present"] and not second[0]["authorization_present"]
    assert second[0]["cache_salt"] == first[0]["cache_salt"]  # the tenant's salt on every attempt

    entry = ledger_of(gw, r.headers["x-request-id"])
    assert [(a["n"], a["deployment"], a["kind"], a["status"]) for a in entry["attempts"]] == [
        (1, "pool-llama-8b", "first", 503), (2, BACKUP, "model_fallback", 200)]
    assert entry["termination"] == "complete" and entry["settlement"] == "actual"
    usage = json.loads(r.body)["usage"]
    expected = math.ceil((usage["prompt_tokens"] * BACKUP_PRICES["input_per_mtok"]
                          + usage["completion_tokens"] * BACKUP_PRICES["output_per_mtok"]) / 1e6)
    assert entry["price_version"] == BACKUP_PRICES["version"]
    assert entry["charged_micros"] == expected
    # Envoy's access log says both: the plan's first candidate and the one that answered.
    logged = access_log_line(gw, r.headers["x-request-id"])
    assert (logged["deployment"], logged["answered_by"], logged["attempts"]) == ("pool-llama-8b", BACKUP, 2)


def access_log_line(stack: Stack, rid: str) -> dict[str, Any]:
    deadline = time.time() + 5
    while time.time() < deadline:
        for line in (stack.logs / "envoy.log").read_text().splitlines():
            if line.startswith("{") and (doc := json.loads(line)).get("request_id") == rid:
                return dict(doc)
        time.sleep(0.1)
    raise AssertionError(f"no access log line for {rid}")


def test_a_healthy_candidate_1_serves_alone(gw: Stack) -> None:
    r = chat(gw, "no fallback needed")
    assert r.status == 200, r.body
    assert (r.headers["x-llmgw-attempts"], r.headers["x-llmgw-deployment"]) == ("1", "pool-llama-8b")
    assert received(gw, "backup-pool") == []
    entry = ledger_of(gw, r.headers["x-request-id"])
    assert [(a["deployment"], a["kind"], a["status"]) for a in entry["attempts"]] == [
        ("pool-llama-8b", "first", 200)]
    assert entry["price_version"] == "2026-11"


def test_a_candidate_not_allowed_for_the_data_class_is_never_tried(gw: Stack) -> None:
    fault_all(gw, "engine-pool", "status=503")
    r = chat(gw, "confidential, and candidate 1 is down", **{"x-llmgw-data-class": "confidential"})
    # Candidate 2 does not serve confidential data: the one retry went to another engine of candidate 1.
    assert_contract_error(r, 502, "upstream_error")
    assert [e["status"] for e in received(gw, "engine-pool")] == [503, 503]
    assert received(gw, "backup-pool") == []
    # Alone, candidate 1 still went through the attempt filter: its credential on both attempts.
    assert all(e["authorization_present"] for e in received(gw, "engine-pool"))
    entry = ledger_of(gw, r.headers["x-request-id"])
    assert [(a["deployment"], a["kind"], a["status"]) for a in entry["attempts"]] == [
        ("pool-llama-8b", "first", 503), ("pool-llama-8b", "transport_retry", 503)]
    assert entry["termination"] == "upstream_error" and entry["charged_micros"] == 0


def test_a_stream_whose_first_byte_is_late_falls_back(gw: Stack) -> None:
    fault_all(gw, "engine-pool", "delay_ms=1500")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    t0 = time.monotonic()
    # A 2 s deadline over two attempts: each gets 1 s to its response headers.
    raw = client.chat.completions.with_raw_response.create(
        model="chat-default", max_tokens=4, stream=True, messages=[{"role": "user", "content": "slow start"}],
        extra_headers={"x-llmgw-deadline-ms": "2000"})
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text
    assert raw.headers["x-llmgw-deployment"] == BACKUP and raw.headers["x-llmgw-attempts"] == "2"
    assert time.monotonic() - t0 < 2.0
    entry = ledger_of(gw, raw.headers["x-request-id"])
    assert [(a["deployment"], a["status"]) for a in entry["attempts"]] == [("pool-llama-8b", 0), (BACKUP, 200)]
    assert entry["termination"] == "complete"


def test_two_slow_candidates_share_one_deadline(gw: Stack) -> None:
    fault_all(gw, "engine-pool", "delay_ms=3000")
    fault_all(gw, "backup-pool", "delay_ms=3000")
    t0 = time.monotonic()
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body(content="both slow", max_tokens=4, stream=True),
                headers={"authorization": f"Bearer {KEY}", "x-llmgw-deadline-ms": "500"}, timeout=30)
    elapsed = time.monotonic() - t0
    assert_contract_error(r, 504, "deadline_exceeded")
    assert elapsed < 0.6, elapsed  # 500 ms + 100 ms: the second attempt had only what was left
    # Both candidates were tried, each within its share of the one deadline.
    assert len(received(gw, "engine-pool")) == 1 and len(received(gw, "backup-pool")) == 1
    entry = ledger_of(gw, r.headers["x-request-id"])
    assert [(a["deployment"], a["status"]) for a in entry["attempts"]] == [("pool-llama-8b", 0), (BACKUP, 0)]
    # Sent, never answered: a stream produced nothing before its first byte, so no output is charged;
    # the prompt may have been processed, so its bound is (extproc/settlement/charge.py failure_charge).
    assert entry["settlement"] == "partial" and entry["usage"]["completion_tokens"] == 0
    assert 0 < entry["charged_micros"] < entry["reserved_micros"]


def test_a_candidate_whose_pool_is_down_is_passed_over_within_the_attempt(tmp_path: Path) -> None:
    """Candidate 1's engines all down (health checks failing): the composite sends attempt 1 to
    candidate 2, and the attempt filter addresses it as candidate 2 (from the host it got)."""
    stack = start_stack(tmp_path / "state", fallback_policy(tmp_path))
    try:
        down = set(stack.engine_urls("engine-pool"))
        for addr, child in stack.engines.items():
            if f"http://{addr}" in down:
                child.stop()
        deadline = time.time() + 15
        r = chat(stack, "candidate 1 is down")
        # Until Envoy's health checks have marked the pool down, attempt 1 meets a refused connection
        # and the retry falls back (2 attempts); then no attempt goes to candidate 1 at all.
        while r.headers.get("x-llmgw-attempts") != "1" and time.time() < deadline:
            assert r.status == 200 and r.headers["x-llmgw-deployment"] == BACKUP, (r.status, r.headers)
            time.sleep(0.5)
            r = chat(stack, "candidate 1 is down")
        assert r.status == 200, r.body
        assert (r.headers["x-llmgw-deployment"], r.headers["x-llmgw-attempts"]) == (BACKUP, "1")
        assert [(e["status"], e["model"]) for e in received(stack, "backup-pool")][-1] == (200, BACKUP_MODEL)
        entry = ledger_of(stack, r.headers["x-request-id"])
        assert [(a["n"], a["deployment"], a["status"]) for a in entry["attempts"]] == [(1, BACKUP, 200)]
    finally:
        stack.stop()
