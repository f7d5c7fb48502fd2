"""The conformance corpus against real vLLM (issue 13): `llmgw conformance --engine vllm` runs every
case through the gateway to vLLM's CPU build serving the generated tiny model, as it runs against the
simulator. What vLLM's API promises must hold there too; what needs a model that behaves (choosing a
tool, writing arguments that match a schema) is recorded, and a random tiny model fails it - which is
what the record is for: such a deployment is not qualified."""

from __future__ import annotations

import shutil
from pathlib import Path

from extproc.config import load_snapshot
from extproc.corpora import quality_corpus
from llmgw.conformance import runner
from llmgw.conformance.corpus import corpus_for, load_corpus
from llmgw.quality.corpus import load_quality
from llmgw.quality.evaluate import evaluate_in
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


def test_the_corpus_against_real_vllm_and_the_quality_gate_it_fails(tmp_path: Path) -> None:
    """One vLLM start for both corpora: the conformance corpus, then the request class's task-quality
    corpus, graded as `llmgw evaluate` grades it. The tiny model's weights are random: it fails the
    quality gate, honestly (nothing in the gate knows which engine it graded)."""
    policy = policy_of(tmp_path, "embed-pool")
    route = load_snapshot(policy).routes["chat-default"]
    quality = load_quality(quality_corpus("general", policy))
    requests = [*CORPUS.cases_requests(), *(t.request for t in quality.tasks)]
    with runner.session(policy, "pool-llama-8b", tmp_path / "run", [route], requests, engine="vllm") as s:
        run = runner.run_corpus(s, CORPUS, "chat-default")
        graded = evaluate_in(s, quality, route, threshold=0.8)
    print({r.id: (r.result, r.detail) for r in graded.results})
    assert [r.id for r in graded.results] == [t.id for t in quality.tasks]
    assert not graded.passed and graded.score < 0.8, graded.score
    assert all(r.result == "pass" or r.detail for r in graded.results)  # each failure says why
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
