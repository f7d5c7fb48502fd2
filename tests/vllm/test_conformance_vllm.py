"""The conformance corpus against real vLLM (issue 13): `llmgw conformance --engine vllm` runs every
case through the gateway to vLLM's CPU build serving the generated tiny model, as it runs against the
simulator. What vLLM's API promises must hold there too; what needs a model that behaves (choosing a
tool, writing arguments that match a schema) is recorded, and a random tiny model fails it - which is
what the record is for: such a deployment is not qualified."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmgw.conformance import runner
from llmgw.conformance.corpus import corpus_for, load_corpus
from tests.conftest import POLICY
from tests.vllm.conftest import without_pool

CORPUS = load_corpus()
# Cases whose outcome is the model's behaviour (a call it chooses, arguments or JSON it writes within
# max_tokens): the tiny model's weights are random. vLLM's side of them (the tool parser, structured
# output, the request checks) is exercised. Seen here: tool arguments `true` under a named tool choice,
# and JSON cut by max_tokens after runs of whitespace.
MODEL_BEHAVIOUR = {"tool-auto", "tool-required", "tool-named", "tool-parallel", "tool-call-streamed",
                   "json-object", "json-schema"}


def policy_of(tmp_path: Path, without: str) -> Path:
    """The example policy without the pool the run does not use (its engines would start too)."""
    policy = tmp_path / "policy"
    shutil.copytree(POLICY, policy)
    without_pool(policy, without)
    return policy


def test_the_corpus_against_real_vllm(tmp_path: Path) -> None:
    run = runner.run(policy_of(tmp_path, "embed-pool"), "pool-llama-8b", CORPUS, tmp_path / "run", engine="vllm")
    results = {r.id: r for r in run.results}
    assert set(results) == {c.id for c in CORPUS.cases}
    for case in CORPUS.cases:
        got = results[case.id]
        if case.fault:  # real vLLM has no admin API to inject faults through
            assert got.result == "not_run", (case.id, got)
        elif case.id not in MODEL_BEHAVIOUR:
            # Messages, system prompts, length and stop, seeds, streams with and without usage,
            # logprobs, n, a tool result turn, the context limit: as against the simulator.
            assert got.result == "pass", (case.id, got.detail)
    print({r.id: (r.result, r.detail) for r in run.results if r.id in MODEL_BEHAVIOUR})


def test_the_embeddings_corpus_against_real_vllm(tmp_path: Path) -> None:
    """vLLM's pooling runner (`--runner pooling --convert embed` on the tiny model) passes every case
    the simulator's does: what an embeddings answer must be does not depend on the weights."""
    corpus = corpus_for("embeddings")
    run = runner.run(policy_of(tmp_path, "engine-pool"), "pool-embed", corpus, tmp_path / "run", engine="vllm")
    assert {r.id: r.result for r in run.results} == {c.id: "pass" for c in corpus.cases}, run.results
