"""The conformance corpus and `llmgw conformance` (issue 13's evidence): the corpus runs through a real
gateway (Envoy, ext_proc, Valkey) against each simulated shape over real HTTP and writes the record
that qualifies the candidate; a corrupted provider fails it; a failing, missing or stale record (the
fingerprint changed) qualifies nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import Evidence
from llmgw.bench_translated import add_anthropic_route, add_provider_route, simulated_provider
from llmgw.conformance import runner
from llmgw.conformance.corpus import Outcome, check, load_corpus
from tests.conftest import POLICY, repin
from tests.e2e.doors.test_translated_route_e2e import AZURE_KEY, AZURE_MODEL, add_azure_route

CORPUS = load_corpus()
CASES = {c.id: c for c in CORPUS.cases}
# What the Anthropic Messages API cannot carry (its loss table), so those cases are `lost`, not run.
ANTHROPIC_LOST = {"seeded-repeat", "json-object", "logprobs", "n-choices"}
# vLLM never refuses: the OpenAI-shaped simulator takes no refusal fault, so these cases do not run there.
REFUSALS = {"refusal", "refusal-streamed"}


def conformance(policy: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "conformance", "--config", str(policy), *args],
                          capture_output=True, text=True, timeout=300)


def check_says(policy: Path) -> str:
    return subprocess.run([sys.executable, "-m", "llmgw", "check", str(policy)], capture_output=True, text=True,
                          timeout=60).stdout


def record(policy: Path, deployment: str) -> Evidence:
    return Evidence.model_validate(yaml.safe_load((policy / f"evidence/{deployment}-conformance.yaml").read_text()))


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    dst = tmp_path / "policy"
    shutil.copytree(POLICY, dst)
    return dst


@pytest.mark.e2e
def test_the_pool_passes_and_its_record_is_what_qualifies_it(policy: Path) -> None:
    (policy / "evidence/pool-llama-8b-conformance.yaml").unlink()
    assert "NOT ELIGIBLE: no passing conformance evidence" in check_says(policy)
    r = conformance(policy, "--route", "chat-default")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = record(policy, "pool-llama-8b")
    snap = load_snapshot(policy)
    assert rec.deployment_ref == snap.deployments["pool-llama-8b"].ref and rec.result == "pass"
    assert rec.corpus_version == CORPUS.version and rec.adapter == "openai-compat@1"
    results = {c.id: c.result for c in rec.cases}
    assert results == {k: "not_run" if k in REFUSALS else "pass" for k in CASES}  # every other case ran
    assert "conformance" in snap.passing_evidence(rec.deployment_ref, date.today())
    assert "qualified" in check_says(policy) and "NOT ELIGIBLE" not in check_says(policy)


@pytest.mark.e2e
def test_changing_a_fingerprint_field_voids_the_record(policy: Path) -> None:
    dep_path = policy / "deployments/pool-llama-8b.yaml"
    dep = yaml.safe_load(dep_path.read_text())
    dep["fingerprint"]["precision"] = "fp8"  # another served system
    dep_path.write_text(yaml.safe_dump(dep))
    repin(policy, "pool-llama-8b")
    assert "NOT ELIGIBLE: no passing conformance" in check_says(policy)  # the old record names the old digest
    assert conformance(policy, "--deployment", "pool-llama-8b").returncode == 0  # earned again for fp8
    assert "NOT ELIGIBLE: no passing conformance" not in check_says(policy)


@pytest.mark.e2e
def test_a_corrupted_provider_fails_the_corpus_and_is_not_qualified(policy: Path, tmp_path: Path) -> None:
    run = runner.run(policy, "pool-llama-8b", CORPUS, tmp_path / "work",
                     engine_args=("--corrupt", "usage", "--corrupt", "tool_calls"))
    failed = {r.id: r.detail for r in run.results if r.result == "fail"}
    assert not run.passed
    assert "no usage" in failed["plain-message"] and "no usage" in failed["stream-with-usage"]
    assert "do not parse" in failed["tool-auto"] and "do not parse" in failed["tool-call-streamed"]
    assert "context-limit" not in failed  # refused by the gateway before the provider: still conformant
    doc = run.evidence(date.today(), 30)
    (policy / "evidence/pool-llama-8b-conformance.yaml").write_text(yaml.safe_dump(doc))
    snap = load_snapshot(policy)
    assert "conformance" not in snap.passing_evidence(run.deployment_ref, date.today())
    assert "NOT ELIGIBLE: no passing conformance" in check_says(policy)


@pytest.fixture(scope="module")
def anthropic_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    child, url = simulated_provider("anthropic", "claude-sim-1", "sk-conformance", tmp_path_factory.mktemp("a") / "log")
    yield url.removeprefix("http://")
    child.stop()


@pytest.mark.e2e
def test_an_anthropic_shaped_provider_passes_and_its_losses_are_recorded(policy: Path, anthropic_sim: str) -> None:
    add_anthropic_route(policy, anthropic_sim, "sk-conformance")
    (policy / "evidence/claude-sim-conformance.yaml").unlink()  # the helper's hand-written one
    r = conformance(policy, "--deployment", "claude-sim")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = record(policy, "claude-sim")
    results = {c.id: c.result for c in rec.cases}
    assert {k for k, v in results.items() if v == "lost"} == ANTHROPIC_LOST
    assert all(v == "pass" for k, v in results.items() if k not in ANTHROPIC_LOST)  # tools, streams, faults
    assert {"seed (unsupported)", "logprobs (unsupported)", "n (unsupported)", "tools (transformed)"} <= set(rec.losses)


@pytest.mark.e2e
def test_an_anthropic_provider_that_mangles_tool_calls_fails(policy: Path, tmp_path: Path) -> None:
    child, url = simulated_provider("anthropic", "claude-sim-1", "sk-bad", tmp_path / "log", 0.02,
                                    "--corrupt", "tool_calls")
    try:
        add_anthropic_route(policy, url.removeprefix("http://"), "sk-bad")
        run = runner.run(policy, "claude-sim", CORPUS, tmp_path / "work", only={"tool-auto", "plain-message"})
    finally:
        child.stop()
    assert {r.id: r.result for r in run.results} == {"plain-message": "pass", "tool-auto": "fail"}


@pytest.mark.e2e
def test_a_gemini_shaped_provider_passes_with_what_it_cannot_carry_lost(policy: Path, tmp_path: Path) -> None:
    child, url = simulated_provider("gemini", "gemini-sim-1", "goog-conformance", tmp_path / "log")
    try:
        add_provider_route(policy, "gemini-sim", "gemini@1", "gemini-api@v1beta", "gemini-sim-1",
                           url.removeprefix("http://"), "goog-conformance", "chat-gemini")
        run = runner.run(policy, "gemini-sim", CORPUS, tmp_path / "work")
    finally:
        child.stop()
    results = {r.id: r.result for r in run.results}
    assert {k for k, v in results.items() if v == "lost"} == {"logprobs", "n-choices"}  # its loss table's
    assert run.passed and all(v == "pass" for k, v in results.items() if k not in ("logprobs", "n-choices"))


BEDROCK_LOST = {"seeded-repeat", "json-object", "json-schema", "logprobs", "n-choices"}


def bedrock_run(policy: Path, work: Path, *corrupt: str, only: set[str] | None = None) -> runner.Run:
    model, key = "anthropic.claude-sim-v1:0", "AKIDCONFORMANCE00001:conformance-secret"
    work.mkdir(exist_ok=True)
    child, url = simulated_provider("bedrock", model, key, work / "log", 0.02, *corrupt)
    try:
        add_provider_route(policy, "bedrock-sim", "bedrock@1", "bedrock-converse@2023-09-30", model,
                           url.removeprefix("http://"), key, "chat-bedrock", options={"region": "eu-west-1"})
        return runner.run(policy, "bedrock-sim", CORPUS, work / "work", only=only)
    finally:
        child.stop()


@pytest.mark.e2e
def test_a_bedrock_shaped_provider_passes_with_what_it_cannot_carry_lost(policy: Path, tmp_path: Path) -> None:
    run = bedrock_run(policy, tmp_path)
    results = {r.id: r.result for r in run.results}
    assert {k for k, v in results.items() if v == "lost"} == BEDROCK_LOST  # its loss table's
    # Tools streamed as pieces of input JSON, SigV4, the event stream's faults: all as the corpus expects.
    assert run.passed and all(v == "pass" for k, v in results.items() if k not in BEDROCK_LOST)


@pytest.mark.e2e
def test_a_bedrock_provider_that_drops_usage_or_mangles_tool_calls_fails(policy: Path, tmp_path: Path) -> None:
    cases = {"plain-message", "stream-with-usage", "tool-auto"}
    run = bedrock_run(policy, tmp_path / "usage", "--corrupt", "usage", only=cases)
    assert {r.id: r.result for r in run.results} == dict.fromkeys(cases, "fail")
    run = bedrock_run(policy, tmp_path / "tools", "--corrupt", "tool_calls", only={"plain-message", "tool-auto"})
    assert {r.id: r.result for r in run.results} == {"plain-message": "pass", "tool-auto": "fail"}


@pytest.mark.e2e
def test_an_azure_deployment_passes(policy: Path, tmp_path: Path) -> None:
    child, url = simulated_provider("azure", AZURE_MODEL, AZURE_KEY, tmp_path / "log")
    try:
        add_anthropic_route(policy, "127.0.0.1:9", "unused")  # the deployment the Azure one is copied from
        add_azure_route(policy, url.removeprefix("http://"))
        run = runner.run(policy, "azure-gpt", CORPUS, tmp_path / "work")
    finally:
        child.stop()
    assert run.passed and all(r.result == ("not_run" if r.id in REFUSALS else "pass") for r in run.results), \
        [r for r in run.results if r.result != "pass"]


def test_a_partial_run_writes_no_record(policy: Path) -> None:
    r = conformance(policy, "--deployment", "pool-llama-8b", "--case", "plain-message")
    assert r.returncode == 2 and "qualifies nothing" in r.stderr


def test_a_record_cannot_say_pass_over_a_failed_case() -> None:
    doc = yaml.safe_load((POLICY / "evidence/pool-llama-8b-conformance.yaml").read_text())
    doc["cases"][0] = {"id": doc["cases"][0]["id"], "result": "fail", "detail": "x"}
    with pytest.raises(ValueError, match="a case failed"):
        Evidence.model_validate(doc)


def test_the_demo_record_was_written_by_the_command_against_the_current_corpus() -> None:
    rec = record(POLICY, "pool-llama-8b")
    assert rec.source == runner.SOURCE and rec.corpus_version == CORPUS.version
    assert {c.id for c in rec.cases} == set(CASES)


# -- the checks, on outcomes made by hand ------------------------------------------------------------

def answer(content: str | None = "hi", usage: dict | None = None, calls: list | None = None,  # type: ignore[type-arg]
           finish: str = "stop") -> Outcome:
    doc = {"choices": [{"message": {"content": content, "tool_calls": calls}, "finish_reason": finish}],
           "usage": usage}
    return Outcome.from_json(200, doc, [])


def test_usage_must_add_up_and_respect_max_tokens() -> None:
    case = CASES["plain-message"]
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8})]) == []
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 9})])
    assert check(case, [answer(usage={"prompt_tokens": 5, "completion_tokens": 33, "total_tokens": 38})])
    assert check(case, [answer(usage=None)]) == ["no usage"]


def test_tool_arguments_must_match_the_tools_schema() -> None:
    case = CASES["tool-auto"]
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    good = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]
    bad = [{"function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "kelvin"}'}}]
    assert check(case, [answer(None, usage, good, "tool_calls")]) == []
    assert "do not match its schema" in " ".join(check(case, [answer(None, usage, bad, "tool_calls")]))
    assert check(case, [answer("text", usage, None, "stop")])


def test_a_refusal_must_say_content_filter() -> None:
    assert check(CASES["refusal"], [answer("", finish="content_filter")]) == []
    assert check(CASES["refusal"], [answer("", finish="stop")])  # an empty normal answer is no refusal
    done = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"%s"}]}\n\ndata: [DONE]\n\n'
    assert check(CASES["refusal-streamed"], [Outcome.from_stream(200, done % b"content_filter", [])]) == []
    assert check(CASES["refusal-streamed"], [Outcome.from_stream(200, done % b"stop", [])])


def test_a_cancelled_stream_must_reach_the_upstream_and_the_ledger() -> None:
    case = CASES["stream-cancelled"]
    out = Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "client_cancel"},
                  upstream={"cancelled": True})
    assert check(case, [out]) == []
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "complete"},
                                upstream={"cancelled": True})])  # settled as if it had finished
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled", ledger={"termination": "client_cancel"},
                                upstream={"output_tokens": 64})])  # the upstream generated on for nobody
    assert check(case, [Outcome(200, stream=True, stream_end="cancelled")])  # nothing observed: no pass


def test_a_stream_must_end_as_the_case_says() -> None:
    ok = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n'
    assert Outcome.from_stream(200, ok, []).stream_end == "done"
    cut = Outcome.from_stream(200, ok.replace(b"data: [DONE]\n\n", b""), [], reset=True)
    assert cut.stream_end == "reset"
    assert check(CASES["stream-truncated"], [cut]) == []
    assert check(CASES["stream-malformed-chunk"], [cut])  # the contract's event was due, not a reset
    assert check(CASES["stream-without-usage"], [Outcome.from_stream(200, ok.replace(b"[DONE]", b"x"), [])])
