"""Shadow traffic (issue 16, part 2): a route copies a share of its read-only requests to a candidate
under evaluation. Envoy's router sends the copy back through the gateway's own listener with a signed
grant, so the copy passes every stage again; its answer never reaches the caller, it is charged to the
tenant's shadow budget, and both requests have ledger entries."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import ConfigError, load_snapshot
from extproc.names import Header
from extproc.shadow import Grant, InvalidGrant, grant_key, issue, shadow_bucket, verify
from extproc.store import budget_key, ledger_entry, ledger_key
from llmgw.local.stack import Stack
from llmgw.ops.store import store_client
from llmgw.render.bootstrap import RenderOptions, render_yaml
from tests.conftest import DEMO_KEYS, POLICY, ledger_of, module_stack
from tests.helpers import assert_contract_error, chat_body, request, unique_marker

ROUTE = "chat-fallback"
SHADOW = {"deployment": "demo-anthropic", "share": 1.0, "tenants": ["acme", "globex"]}
SHADOW_BUDGET = {"name": "acme-shadow", "tenant": "acme", "traffic": "shadow", "window": "total",
                 "limit_micros": 50_000_000}


def shadow_policy(root: Path) -> Path:
    dst = root / "policy"
    shutil.copytree(POLICY, dst)
    route = yaml.safe_load((dst / f"routes/{ROUTE}.yaml").read_text())
    route["shadow"] = SHADOW
    route["candidates"][1]["data_classes"] = ["public", "internal"]  # never confidential to the shadow
    (dst / f"routes/{ROUTE}.yaml").write_text(yaml.safe_dump(route))
    gw = yaml.safe_load((dst / "gateway.yaml").read_text())
    gw["budgets"].append(SHADOW_BUDGET)  # globex has none: it is never shadowed
    (dst / "gateway.yaml").write_text(yaml.safe_dump(gw))
    return dst


def test_a_grant_is_signed_expires_and_cannot_be_altered() -> None:
    key = grant_key("secret")
    g = Grant(of="r1", tenant="acme", subject="k1", route=ROUTE, data_class="internal",
              deployment="demo-anthropic", expires=time.time() + 30)
    token = issue(key, g)
    assert verify(key, token) == g
    payload, mac = token.split(".")
    forged = issue(grant_key("another gateway"), g)
    for bad in (forged, f"{payload[:-2]}xx.{mac}", f"{payload}.", "", "a.b.c", f"{payload}.{mac[:-1]}é"):
        with pytest.raises(InvalidGrant):
            verify(key, bad)
    with pytest.raises(InvalidGrant, match="expired"):
        verify(key, token, now=g.expires + 1)
    ids = [f"req-{i}" for i in range(4000)]
    assert 0.08 < sum(shadow_bucket(i) < 0.1 for i in ids) / len(ids) < 0.12


def test_the_shadow_is_a_candidate_and_only_its_clusters_get_the_mirror(tmp_path: Path) -> None:
    snap = load_snapshot(shadow_policy(tmp_path))
    text = render_yaml(snap, RenderOptions.from_snapshot(snap))
    assert "llmgw_shadow" in text and text.count("request_mirror_policies") > 0
    assert "admitted_fallback_chat-fallback_0_1_shadow" in text
    assert "admitted_fallback_chat-gemini" in text and "admitted_fallback_chat-gemini_0_shadow" not in text
    dst = tmp_path / "other"
    shutil.copytree(POLICY, dst)
    route = yaml.safe_load((dst / "routes/chat-default.yaml").read_text())
    route["shadow"] = SHADOW  # not a candidate of chat-default
    (dst / "routes/chat-default.yaml").write_text(yaml.safe_dump(route))
    with pytest.raises(ConfigError, match=r"shadow\.deployment"):
        load_snapshot(dst)


gw = module_stack("shadow", shadow_policy, simulate_providers=True)


def provider_log(stack: Stack) -> list[dict[str, Any]]:
    (host, port), = stack.render.providers["demo-anthropic"]
    return request(f"http://{host}:{port}/admin/requests").json()


def chat(stack: Stack, tenant: str, body: dict[str, Any], **headers: str) -> Any:
    return request(f"{stack.url}/v1/chat/completions", "POST", body,
                   {"authorization": f"Bearer {DEMO_KEYS[tenant]}", **headers}, timeout=30)


def copies(stack: Stack, tenant: str, of: str, wait_s: float = 5.0) -> list[dict[str, Any]]:
    """The ledger entries of the shadow copies of request `of` (waits for one, up to wait_s)."""
    client = store_client(str(stack.store_url))
    deadline = time.time() + wait_s
    while True:
        found = [e for _, f in client.xrange(ledger_key(tenant)) if (e := ledger_entry(f)).get("shadow_of") == of]
        if found or time.time() > deadline:
            return found
        time.sleep(0.05)


def settled_micros(stack: Stack, tenant: str, budget: str, window: str) -> int:
    h = store_client(str(stack.store_url)).hgetall(budget_key(tenant, budget, window))
    return int(h.get("settled_micros", 0))


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_the_copy_never_answers_the_caller_and_is_charged_to_the_shadow_budget(gw: Stack, stream: bool) -> None:
    marker = unique_marker("shadowed")
    before = settled_micros(gw, "acme", "acme-shadow", "total")
    r = chat(gw, "acme", chat_body(ROUTE, content=f"hello {marker}", max_tokens=8, stream=stream))
    assert r.status == 200 and r.headers["x-llmgw-deployment"] == "pool-llama-8b"
    if stream:
        assert r.body.decode().rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["message"]["content"]
    rid = r.headers["x-request-id"]
    (copy,) = copies(gw, "acme", rid)
    primary = ledger_of(gw, rid, "acme")
    assert primary["shadow"] == "demo-anthropic" and primary["charged_micros"] > 0
    # The copy: the candidate under evaluation answered it, as the same tenant and data class, and its
    # own reservation was charged to the shadow budget only.
    assert copy["request_id"] != rid and copy["tenant"] == "acme" and copy["data_class"] == primary["data_class"]
    assert copy["identity_kind"] == "shadow" and copy["termination"] == "complete"
    assert copy["attempts"][-1]["deployment"] == "demo-anthropic" and copy["charged_micros"] > 0
    assert settled_micros(gw, "acme", "acme-shadow", "total") - before == copy["charged_micros"]
    seen = [e for e in provider_log(gw) if marker in str(e["messages"])]
    assert len(seen) == 1 and seen[0]["api_key_present"]  # with the provider's own key, and never the grant
    assert seen[0]["request_id"] == copy["request_id"] and Header.SHADOW_GRANT not in seen[0]["headers"]


@pytest.mark.e2e
def test_no_copy_of_a_data_class_the_shadow_may_not_receive_or_without_a_shadow_budget(gw: Stack) -> None:
    marker = unique_marker("confidential")
    r = chat(gw, "acme", chat_body(ROUTE, content=f"secret plans {marker}", max_tokens=4),
             **{"x-llmgw-data-class": "confidential"})
    assert r.status == 200
    rid = r.headers["x-request-id"]
    assert "shadow" not in ledger_of(gw, rid, "acme")
    assert copies(gw, "acme", rid, wait_s=1.0) == []
    assert not [e for e in provider_log(gw) if marker in str(e)]
    g = chat(gw, "globex", chat_body(ROUTE, content="no shadow budget", max_tokens=4))
    assert g.status == 200 and "shadow" not in ledger_of(gw, g.headers["x-request-id"], "globex")


@pytest.mark.e2e
def test_a_client_cannot_bring_its_own_grant(gw: Stack) -> None:
    g = Grant(of="x", tenant="acme", subject="acme-demo", route=ROUTE, data_class="internal",
              deployment="demo-anthropic", expires=time.time() + 30)
    for token in (issue(grant_key("not this gateway's secret"), g), "garbage", "x" * 9000, "\u00e9t\u00e9.\u00ff"):
        r = request(f"{gw.url}/v1/chat/completions", "POST", chat_body(ROUTE, max_tokens=4),
                    {Header.SHADOW_GRANT: token})
        assert_contract_error(r, 401, "unauthenticated")


def test_only_read_only_requests_in_the_share_class_and_tenants_are_copied(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from extproc.exchange import Exchange, Identity
    from extproc.stages.route import RequestFacts, shadow_copy

    snap = load_snapshot(shadow_policy(tmp_path))
    route = snap.routes[ROUTE]
    facts = RequestFacts(data_class="internal", regions=None, today=datetime.now(UTC).date(), prompt_bound=20,
                         n_messages=1, max_tokens=16)

    def copied(tenant: str = "acme", effects: tuple[str, ...] = (), rid: str = "r-1", **facts_over: Any) -> str:
        ex = Exchange(snapshot=snap, shadow_key=b"k", request_id=rid, data_class="internal", effects=effects,
                      identity=Identity(tenant, f"{tenant}-demo", "api_key"), route=route,
                      deployment=snap.deployments["pool-llama-8b"], body=chat_body(ROUTE))
        shadow_copy(ex, route, dataclasses.replace(facts, **facts_over))
        return ex.shadow

    assert copied() == "demo-anthropic"
    assert copied(effects=("write",)) == ""  # a tool that can change something: never copied
    assert copied(tenant="globex") == ""  # no shadow budget
    assert copied(data_class="confidential") == ""  # the shadow candidate may not receive it
    half = route.model_copy(update={"shadow": route.shadow.model_copy(update={"share": 0.5})})  # type: ignore[union-attr]
    ex = Exchange(snapshot=snap, shadow_key=b"k", data_class="internal",
                  identity=Identity("acme", "acme-demo", "api_key"), deployment=snap.deployments["pool-llama-8b"])
    taken = 0
    for i in range(400):
        ex.request_id, ex.shadow = f"r-{i}", ""
        shadow_copy(ex, half, facts)
        taken += ex.shadow == "demo-anthropic"
    assert 160 < taken < 240
