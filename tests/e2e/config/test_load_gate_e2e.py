"""The load gate (invariant 17): a route that requires `load` evidence serves no candidate until a sweep
through the running gateway (`llmgw bench sweep --config --evidence`) earned it: every request class of
the trace held its objective jointly at its declared peak rate. The sweep measures a route that serves
(chat-default); its record qualifies every route of the same retry and fallback policy and class (here
chat-gated, the same route that requires load evidence). A peak the sweep never offered fails the
record; a changed objective voids a passing one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import Evidence
from llmgw.conformance.record import record_path
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, serving_directory, start_stack
from tests.helpers import chat_body, request

KEY = DEMO_KEYS["acme"]


def set_peak(policy: Path, peak: float, ttft_ms: int = 5000) -> None:
    path = policy / "gateway.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["request_classes"]["read_only_chat"]["slo"] = {"ttft_ms": ttft_ms, "tpot_ms": 1000, "e2e_ms": 30000,
                                                       "attainment": 0.9, "peak_rps": peak}
    path.write_text(yaml.safe_dump(doc))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("load-gate")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    route = yaml.safe_load((policy / "routes/chat-default.yaml").read_text())
    route.update(route_contract="chat-gated", requires_load_evidence=True)
    (policy / "routes/chat-gated.yaml").write_text(yaml.safe_dump(route))
    set_peak(policy, 1000)  # a peak no sweep here reaches
    s = start_stack(tmp / "state", policy)
    up = s.write_up_json()  # what the sweep reads: the gateway's URL and the tenants' keys
    up.write_text(json.dumps({**json.loads(up.read_text()), "tenants": {"acme": {"api_key": KEY}}}))
    yield s
    s.stop()




def chat(stack: Stack) -> tuple[int, bytes]:
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body("chat-gated", max_tokens=4),
                headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    return r.status, r.body


def sweep(stack: Stack, tmp: Path) -> subprocess.CompletedProcess[str]:
    tmp.mkdir(parents=True)
    trace = tmp / "trace.jsonl"  # 12 short streams over 2.75 s: 4.4 req/s at speed 1
    trace.write_text("".join(json.dumps({
        "at": i * 0.25, "request_class": "read_only_chat", "route": "chat-default", "tenant": "acme",
        "data_class": "internal", "input_tokens": 40, "output_tokens": 6, "stream": True}) + "\n" for i in range(12)))
    return subprocess.run([sys.executable, "-m", "llmgw", "bench", "sweep", str(trace), "--state-dir",
                           str(stack.opts.state_dir), "--config", str(stack.snapshot.directory), "--evidence",
                           "--speeds", "0.5,1", "--pause", "0.2", "-o", str(tmp / "out")],
                          capture_output=True, text=True, timeout=300)


def load_record(stack: Stack) -> Evidence:
    path = record_path(stack.snapshot.directory, "pool-llama-8b", "load", "chat-default")
    return Evidence.model_validate(yaml.safe_load(path.read_text()))


def test_a_route_that_requires_load_evidence_serves_once_a_sweep_earned_it(gw: Stack, tmp_path: Path) -> None:
    policy = gw.snapshot.directory
    status, body = chat(gw)
    assert status == 503 and b"pool-llama-8b: evidence" in body, body  # no load record yet

    r = sweep(gw, tmp_path / "unreached")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = load_record(gw)
    assert rec.result == "fail" and rec.load is not None
    judged = rec.load.classes["read_only_chat"]
    assert (judged.peak_rps, judged.holds) == (1000, False) and judged.offered_rps < 1000  # never offered its peak
    serving_directory(gw)
    assert chat(gw)[0] == 503

    set_peak(policy, 2)  # a peak the sweep's levels offer (2.2 and 4.4 req/s)
    r = sweep(gw, tmp_path / "reached")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = load_record(gw)
    assert rec.result == "pass", r.stdout
    assert rec.load is not None and rec.load.mu_rps > 0 and rec.load.knee_rps is not None
    judged = rec.load.classes["read_only_chat"]
    assert judged.holds and judged.offered_rps >= 2 and judged.attainment >= 0.9
    assert rec.basis is not None and rec.basis.route_policy_digest == load_snapshot(policy).routes[
        "chat-default"].policy_digest
    assert "per request class" in r.stdout and "wrote" in r.stdout
    serving_directory(gw)
    assert chat(gw)[0] == 200

    set_peak(policy, 2, ttft_ms=4000)  # another objective: the record was judged on the old one
    serving_directory(gw)
    status, body = chat(gw)
    assert status == 503 and b"evidence" in body
    snap = load_snapshot(policy)
    assert any("objectives of read_only_chat changed" in w for w in snap.voided[snap.deployments["pool-llama-8b"].ref])
