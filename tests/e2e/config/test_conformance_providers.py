"""`llmgw conformance` against each hosted provider shape (Anthropic, Gemini, Bedrock, Azure), simulated
over real HTTP behind a real gateway: each passes with what its adapter cannot carry recorded as lost,
and a provider that drops usage or mangles tool calls fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.bench.translated import add_anthropic_route, add_provider_route, simulated_provider
from llmgw.conformance import runner
from llmgw.conformance.record import record_path
from tests.conftest import module_provider
from tests.e2e.config.test_conformance import CORPUS, REFUSALS, conformance, record
from tests.e2e.doors.test_translated_route_e2e import AZURE_KEY, AZURE_MODEL, add_azure_route

# What the Anthropic Messages API cannot carry (its loss table), so those cases are `lost`, not run.
ANTHROPIC_LOST = {"seeded-repeat", "json-object", "logprobs", "n-choices"}


anthropic_sim = module_provider("anthropic", "claude-sim-1", "sk-conformance")


@pytest.mark.e2e
def test_an_anthropic_shaped_provider_passes_and_its_losses_are_recorded(policy: Path, anthropic_sim: str) -> None:
    add_anthropic_route(policy, anthropic_sim.removeprefix("http://"), "sk-conformance")
    record_path(policy, "claude-sim", "conformance", "chat-anthropic").unlink()  # the helper's provisional one
    r = conformance(policy, "--deployment", "claude-sim")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = record(policy, "claude-sim", "chat-anthropic")
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


BEDROCK_LOST = {"seeded-repeat", "json-object", "logprobs", "n-choices"}  # (a schema: through a forced tool)


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
