"""The demo policy's hosted routes (issue 13): `llmgw up` serves each hosted deployment on loopback
with a simulated provider of its API shape (the stack's `simulate_providers`), keyed by its credential
reference (a Bedrock-shaped one's is an AWS key pair); `chat-anthropic`, `chat-gemini` and
`chat-bedrock` are served through their adapters, and `chat-fallback`
falls back from the pool to the Anthropic-shaped provider before the first byte. Their conformance
evidence was written by `llmgw conformance --simulate-providers`."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date
from pathlib import Path

import openai
import pytest
import yaml

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, start_stack
from tests.helpers import inject_fault, request

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("demo-providers"), simulate_providers=True)
    yield s
    s.stop()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=DEMO_KEYS["acme"], max_retries=0)


@pytest.mark.parametrize("route, deployment", [("chat-anthropic", "demo-anthropic"), ("chat-gemini", "demo-gemini"),
                                               ("chat-bedrock", "demo-bedrock")])
def test_each_hosted_route_is_served_by_its_simulated_provider(up: Stack, route: str, deployment: str) -> None:
    raw = sdk(up).chat.completions.with_raw_response.create(model=route, max_tokens=5,
                                                            messages=[{"role": "user", "content": f"hi {route}"}])
    assert raw.headers["x-llmgw-deployment"] == deployment and raw.parse().usage.completion_tokens == 5  # type: ignore[union-attr]
    (host, port), = up.render.providers[deployment]
    received = request(f"http://{host}:{port}/admin/requests").json()
    assert any(f"hi {route}" in str(e["messages"]) and e["api_key_present"] for e in received)


def test_the_fallback_route_crosses_shapes_when_the_pool_fails(up: Stack) -> None:
    marker = inject_fault(up.engine_urls("engine-pool"), "status=503", count=4)
    raw = sdk(up).chat.completions.with_raw_response.create(model="chat-fallback", max_tokens=4,
                                                            messages=[{"role": "user", "content": marker}])
    assert raw.headers["x-llmgw-deployment"] == "demo-anthropic" and raw.headers["x-llmgw-attempts"] == "2"
    entry = ledger_of(up, raw.headers["x-request-id"], "acme")
    assert [a["kind"] for a in entry["attempts"]] == ["first", "model_fallback"]


def test_the_demo_evidence_was_written_by_the_conformance_command() -> None:
    for deployment, route in (("demo-anthropic", "chat-anthropic"), ("demo-gemini", "chat-gemini"),
                              ("demo-bedrock", "chat-bedrock"), ("pool-llama-8b", "chat-default")):
        rec = yaml.safe_load((POLICY / f"evidence/{deployment}-conformance-{route}.yaml").read_text())
        assert rec["source"] == "llmgw conformance" and rec["result"] == "pass"
        assert date.fromisoformat(str(rec["expires_at"])) > date.today()
        assert not [c for c in rec["cases"] if c["result"] not in ("pass", "lost", "not_run")]
        # Only what cannot be injected there goes unrun: the refusals, which vLLM never makes.
        assert {c["id"] for c in rec["cases"] if c["result"] == "not_run"} <= {"refusal", "refusal-streamed"}


def test_compose_serves_the_hosted_deployments_by_name() -> None:
    root = Path(__file__).parents[3]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    envoy = yaml.safe_load((root / "envoy/envoy.compose.yaml").read_text())
    for deployment, api in (("demo-anthropic", "anthropic"), ("demo-gemini", "gemini"), ("demo-bedrock", "bedrock")):
        service = compose["services"][deployment]
        assert service["command"][service["command"].index("--api") + 1] == api
        (cluster,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == f"dep_{deployment}"]
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert address["socket_address"]["address"] == deployment
