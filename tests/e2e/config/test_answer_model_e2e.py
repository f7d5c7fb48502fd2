"""A hosted deployment's answers checked against its fingerprint (invariant 17, llmgw/ops/engines.py): a
provider that quietly answers with another model than the deployment declares is seen in the ledger
(`upstream_model`, JSON and streams, translated from its own shape), and `llmgw up`'s engine check
writes a `model_mismatch` void that takes the candidate out through the real Envoy; a dated version of
the declared model is the same model."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.config import load_snapshot
from llmgw.bench.translated import PROVIDER_MODEL, add_anthropic_route
from llmgw.local import up_loops
from llmgw.local.stack import Stack
from llmgw.ops import engines, gateway_loops
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_provider, serving_directory, start_stack
from tests.helpers import chat_body, request

KEY = DEMO_KEYS["acme"]
PROVIDER_KEY = "sk-answer-model"
SWAPPED = "claude-other-2"  # what the provider's answers name

provider = module_provider("anthropic", PROVIDER_MODEL, PROVIDER_KEY, "--answer-model", SWAPPED)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, provider: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("answer-model")
    policy = tmp / "policy"
    shutil.copytree(POLICY, policy)
    add_anthropic_route(policy, provider.removeprefix("http://"), PROVIDER_KEY, route="chat-swapped")
    s = start_stack(tmp / "state", policy)
    yield s
    s.stop()


def chat(stack: Stack, **extra: object) -> tuple[int, dict[str, str], bytes]:
    r = request(f"{stack.url}/v1/chat/completions", "POST", chat_body("chat-swapped", max_tokens=4, **extra),
                headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    return r.status, r.headers, r.body


SEARCH = {"type": "function", "function": {"name": "search_docs", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("settles", "extra", "idempotent"), [
    ("checked", {"tools": [SEARCH]}, False),  # the meter holds it for the answer checks
    ("metered", {}, True),  # the meter records it for replay
    ("checked_stream", {"tools": [SEARCH], "stream": True}, False),  # ext_proc's stream guard
    ("kept_stream", {"stream": True}, True),
])
def test_the_ledger_keeps_the_model_the_upstream_named_on_every_settling_path(
        gw: Stack, settles: str, extra: dict[str, object], idempotent: bool) -> None:
    """The caller reads the route's name as the answer's model; the ledger keeps the provider's, which
    the engine check holds to the fingerprint (a route's name there voided honest providers)."""
    r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body("chat-swapped", max_tokens=4, **extra),
                headers={"authorization": f"Bearer {KEY}",
                         **({"idempotency-key": f"answer-model-{settles}"} if idempotent else {})}, timeout=30)
    assert r.status == 200 and b"chat-swapped" in r.body, r.body
    assert ledger_of(gw, r.headers["x-request-id"], "acme")["attempts"][-1]["upstream_model"] == SWAPPED


def test_a_dated_version_is_the_declared_model() -> None:
    assert engines.names_model("gpt-4o-2024-08-06", "gpt-4o") and engines.names_model("claude-sim-1", "claude-sim-1")
    assert not engines.names_model("claude-other-2", "claude-sim-1") and not engines.names_model("gpt-4", "gpt-4o")


def test_a_provider_answering_with_another_model_leaves_routing(gw: Stack) -> None:
    t0 = time.time()
    status, headers, _ = chat(gw)
    assert status == 200
    attempt = ledger_of(gw, headers["x-request-id"], "acme")["attempts"][-1]
    assert (attempt["deployment"], attempt["upstream_model"]) == ("claude-sim", SWAPPED)
    status, headers, body = chat(gw, stream=True)
    assert status == 200 and b"[DONE]" in body
    assert ledger_of(gw, headers["x-request-id"], "acme")["attempts"][-1]["upstream_model"] == SWAPPED

    outcome = gateway_loops.engine_verify(up_loops.targets(gw, gw.snapshot.directory), since=t0)
    assert f"its answers name model '{SWAPPED}', the fingerprint declares '{PROVIDER_MODEL}'" in outcome, outcome
    voids = sorted((gw.snapshot.directory / "evidence/voids").glob("claude-sim-model_mismatch-*.yaml"))
    assert len(voids) == 1
    serving_directory(gw)
    status, _, body = chat(gw)
    assert status == 503 and b"claude-sim: evidence, model_mismatch" in body, body
    # The pool's answers name the model it declares: no void for it.
    assert not list((gw.snapshot.directory / "evidence/voids").glob("pool-llama-8b-*"))


def test_engine_check_reads_no_hosted_answer_it_was_not_given(tmp_path: Path) -> None:
    snap = load_snapshot(POLICY)
    entries = [{"attempts": [{"deployment": "demo-anthropic", "upstream_model": "claude-x"}]},
               {"attempts": [{"deployment": "pool-llama-8b", "upstream_model": "another"}]},  # pools: probed
               {"attempts": [{"deployment": "demo-bedrock"}]}]  # Converse names no model
    found = engines.answer_findings(snap, entries)
    assert [(f.deployment, f.served) for f in found] == [("demo-anthropic", "claude-x")]
