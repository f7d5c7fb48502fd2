"""The fingerprint checked against the running engine (invariant 17, llmgw/ops/engines.py): a pool whose
engines serve another context window than the deployment declares loses its evidence at once, through
the real Envoy: its own route refuses (the ledger names the engine mismatch), the fallback route moves to
the other candidate, `llmgw check` and the metrics say why; `llmgw up`'s loop runs the same check and
every worker's /status shows the loop's state."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from extproc.config import load_snapshot
from llmgw.local import up_loops
from llmgw.local.stack import Stack
from llmgw.ops import engines, gateway_loops
from llmgw.ops.loops import Loops
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, serving_directory, start_stack
from tests.helpers import chat_body, llmgw, request
from tests.promtext import scrape, value

KEY = DEMO_KEYS["acme"]
WINDOW = 4096  # what the engines serve; the deployment declares 131072


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("engine-check")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    # The engines' own flags come last: they serve a window other than the fingerprint's deployment declares.
    s = start_stack(tmp / "state", policy, engine_args=("--max-model-len", str(WINDOW)), simulate_providers=True)
    yield s
    s.stop()


def chat(stack: Stack, route: str) -> tuple[int, dict[str, str], bytes]:
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body(route, max_tokens=4),
                headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    return r.status, r.headers, r.body




def test_compare_names_each_field_an_engine_serves_otherwise() -> None:
    dep = load_snapshot(POLICY).deployments["pool-llama-8b"]
    same = engines.Served((dep.served_model,), dep.context_window, "0.11.0",
                          {"block_size": "16", "enable_prefix_caching": "True"})
    assert engines.compare(dep, "e:1", same) == []
    other = engines.Served(("another/model",), 8192, "0.10.2", {"block_size": "32", "enable_prefix_caching": "False"})
    assert {f.field for f in engines.compare(dep, "e:1", other)} == {
        "model", "max_model_len", "engine version", "cache_config_info block_size",
        "cache_config_info enable_prefix_caching"}
    # What an engine does not report is not compared; a model it does not name is not served.
    silent = engines.Served(None, None, None, None)
    assert [f.field for f in engines.compare(dep, "e:1", silent)] == ["model"]


def test_a_mismatched_engine_voids_the_evidence_and_moves_routing(gw: Stack) -> None:
    policy = gw.snapshot.directory
    status, headers, _ = chat(gw, "chat-fallback")
    assert status == 200 and headers["x-llmgw-deployment"] == "pool-llama-8b"  # the pool first, as declared

    check = engines.verify(load_snapshot(policy), {"engine-pool": gw.engine_urls("engine-pool")})
    assert {(f.field, f.declared, f.served) for f in check.findings} == {("max_model_len", "131072", str(WINDOW))}
    assert len(check.findings) == 2 and not check.unreachable  # both engines of the pool
    written, _ = engines.apply(load_snapshot(policy), check, datetime.now(UTC))
    assert [p.name for p in written] == ["pool-llama-8b-engine_mismatch.yaml"]
    assert engines.apply(load_snapshot(policy), check, datetime.now(UTC)) == ([], [])  # the same finding: no rewrite
    serving_directory(gw)

    status, _, body = chat(gw, "chat-default")  # its only candidate
    assert status == 503 and b"no_qualified_route" in body and b"engine_mismatch" in body, body
    status, headers, _ = chat(gw, "chat-fallback")  # the other candidate takes over
    assert status == 200 and headers["x-llmgw-deployment"] == "demo-anthropic"
    entry = ledger_of(gw, headers["x-request-id"], "acme")
    assert entry["disqualified"] == "pool-llama-8b: engine_mismatch, evidence"

    out = llmgw("check", str(policy)).stdout
    assert ("route chat-default: candidate pool-llama-8b: NOT ELIGIBLE: no passing conformance, quality_gate evidence"
            in out and f"engine mismatch: engine {gw.engine_urls('engine-pool')[0].removeprefix('http://')} serves "
            f"max_model_len '{WINDOW}', the fingerprint declares '131072'" in out), out
    metrics = scrape(gw.metrics_url.removesuffix("/metrics"))
    assert value(metrics, "llmgw_evidence_voided", deployment="pool-llama-8b") > 0


def test_the_up_loop_runs_the_check_and_the_workers_show_its_state(gw: Stack) -> None:
    loops = Loops(gw.loops_state)
    loops.add("engine_verify", 3600, lambda: gateway_loops.engine_verify(up_loops.targets(gw, gw.snapshot.directory)))
    state = loops.run_now("engine_verify")
    assert state.runs == 1 and not state.error
    assert f"max_model_len '{WINDOW}'" in state.last_outcome
    shown = request(gw.status_urls[0]).json()["loops"]
    assert shown["engine_verify"]["runs"] == 1 and shown["engine_verify"]["error"] == ""
    # A loop whose run raises keeps its state and runs again.
    loops.add("broken", 3600, lambda: 1 / 0)  # type: ignore[arg-type,return-value]
    assert loops.run_now("broken").error.startswith("ZeroDivisionError")
    assert request(gw.status_urls[-1]).json()["loops"]["broken"]["error"].startswith("ZeroDivisionError")


def test_the_void_is_lifted_when_the_engines_serve_what_is_declared_again(gw: Stack, tmp_path: Path) -> None:
    policy = gw.snapshot.directory
    assert engines.void_path(policy, "pool-llama-8b").exists()
    snap = load_snapshot(policy)
    matching = engines.Check((), (), ("pool-llama-8b",))  # what verify says of engines that match
    _, removed = engines.apply(snap, matching, datetime.now(UTC))
    assert removed == [engines.void_path(policy, "pool-llama-8b")]
    serving_directory(gw)
    status, headers, _ = chat(gw, "chat-fallback")
    assert status == 200 and headers["x-llmgw-deployment"] == "pool-llama-8b"
