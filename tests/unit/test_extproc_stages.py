"""The pipeline's stages in isolation, and the receive loop with real ext_proc messages (no Envoy)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import load_snapshot
from extproc.config.reload import Live
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange, Identity
from extproc.pipeline import build_stages, run_stages
from extproc.service.processor import Processor
from extproc.stages.identity import CallerIdentity, bearer_token
from extproc.stages.intake import Intake
from extproc.stages.route import RouteSelection, tenant_salts
from extproc.store import Store
from tests.conftest import DEMO_KEYS, EARNED, EXAMPLE_POLICY, POLICY, ROOT, valkey_url

SNAP = load_snapshot(POLICY)
SALTS = tenant_salts("test-secret", SNAP.gateway.tenants)
HEADER_STAGES = build_stages()[:1]  # identity: needs only the headers


def body_stages() -> tuple[Any, ...]:
    """The stages after identity, with a real store (one client per event loop)."""
    return build_stages(store=Store(valkey_url()))[1:]


def exchange(body: Any = None, headers: dict[str, str] | None = None, tenant: str | None = "acme") -> Exchange:
    ex = Exchange(snapshot=SNAP, cache_salts=SALTS, method="POST", path="/v1/chat/completions",
                  headers=headers or {})
    ex.raw_body = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
    if tenant:
        ex.identity = Identity(tenant=tenant, subject="k", kind="api_key")
    return ex


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def code_of(ex: Exchange, stages: Any) -> ErrorCode | None:
    try:
        run(run_stages(stages, ex))
    except GatewayError as e:
        return e.code
    return None


@pytest.mark.parametrize(("auth", "expected"), [
    (None, ErrorCode.UNAUTHENTICATED),
    ("", ErrorCode.UNAUTHENTICATED),
    ("Bearer", ErrorCode.UNAUTHENTICATED),
    ("Token " + DEMO_KEYS["acme"], ErrorCode.UNAUTHENTICATED),
    ("Bearer " + DEMO_KEYS["acme"] + "x", ErrorCode.UNAUTHENTICATED),
    ("Bearer " + DEMO_KEYS["acme"], None),
    ("bearer " + DEMO_KEYS["acme"], None),
], ids=["none", "empty", "scheme-alone", "token-scheme", "key-and-more", "bearer-key", "lowercase-scheme"])
def test_identity(auth: str | None, expected: ErrorCode | None) -> None:
    ex = exchange(headers={"authorization": auth} if auth is not None else {}, tenant=None)
    assert code_of(ex, HEADER_STAGES) == expected
    if expected is None:
        assert ex.identity is not None and ex.identity.tenant == "acme"


def _policy_with_key(tmp_path: Path, **key_fields: Any) -> Path:
    """The session's policy with acme's key (in keys.yaml) changed."""
    dst = tmp_path / "p"
    shutil.copytree(POLICY, dst)
    doc = yaml.safe_load((dst / "keys.yaml").read_text())
    next(k for k in doc["keys"] if k["tenant"] == "acme").update(key_fields)
    (dst / "keys.yaml").write_text(yaml.safe_dump(doc))
    return dst


@pytest.mark.parametrize("fields", [{"revoked": True}, {"expires": "2020-01-01"}])
def test_revoked_or_expired_key_is_refused(tmp_path: Path, fields: dict[str, Any]) -> None:
    snap = load_snapshot(_policy_with_key(tmp_path, **fields))
    ex = Exchange(snapshot=snap, headers={"authorization": "Bearer " + DEMO_KEYS["acme"]})
    with pytest.raises(GatewayError) as e:
        run(CallerIdentity().run(ex))
    assert e.value.code is ErrorCode.UNAUTHENTICATED


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_identity_never_crashes_on_any_header(value: str) -> None:
    ex = exchange(headers={"authorization": value}, tenant=None)
    assert code_of(ex, HEADER_STAGES) in (ErrorCode.UNAUTHENTICATED, None)


@given(st.text(max_size=200))
def test_bearer_token_parsing(value: str) -> None:
    tok = bearer_token(value)
    assert tok is None or (tok and value.lower().startswith("bearer ") and tok == tok.strip())


@given(st.binary(max_size=2000))
@settings(max_examples=300, deadline=None)
def test_intake_never_crashes_on_bytes(body: bytes) -> None:
    ex = exchange(body)
    assert code_of(ex, (Intake(),)) in (ErrorCode.INVALID_REQUEST, None)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=20)


@given(st.dictionaries(st.sampled_from(["model", "messages", "stream", "max_tokens", "x"]), json_values))
@settings(max_examples=300, deadline=None)
def test_body_stages_only_raise_contract_errors(body: dict[str, Any]) -> None:
    ex = exchange(body)
    try:
        run(run_stages(body_stages(), ex))
    except GatewayError as e:
        assert e.code in (ErrorCode.INVALID_REQUEST, ErrorCode.UNSUPPORTED_FIELD, ErrorCode.ROUTE_NOT_FOUND)


def test_route_rewrites_model_for_the_deployment() -> None:
    ex = exchange({"model": "chat-default", "messages": [{"role": "user", "content": "hi"}]})
    run(run_stages(body_stages(), ex))
    assert ex.cluster == "pool_engine-pool" and ex.deployment is not None
    assert json.loads(ex.upstream_body or b"")["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    md = ex.metadata()
    assert md["cluster"] == "pool_engine-pool" and md["tenant"] == "acme" and md["revision"] == SNAP.revision


def test_route_sets_the_tenants_cache_salt_over_the_clients() -> None:
    salts = {}
    for tenant in ("acme", "globex"):
        ex = exchange({"model": "chat-default", "cache_salt": "chosen-by-client",
                       "messages": [{"role": "user", "content": "hi"}]}, tenant=tenant)
        run(run_stages(body_stages(), ex))
        salts[tenant] = json.loads(ex.upstream_body or b"")["cache_salt"]
    assert salts["acme"] == SALTS["acme"] and salts["globex"] == SALTS["globex"]
    assert salts["acme"] != salts["globex"] and "chosen-by-client" not in salts.values()


def test_salts_depend_on_the_secret() -> None:
    assert tenant_salts("a", ["acme"]) != tenant_salts("b", ["acme"])
    assert tenant_salts("a", ["acme"]) == tenant_salts("a", ["acme"])


def test_missing_salt_fails_closed() -> None:
    ex = exchange({"model": "chat-default", "messages": [{"role": "user", "content": "hi"}]})
    ex.cache_salts = {}
    assert code_of(ex, body_stages()) is ErrorCode.POLICY_UNAVAILABLE


def _variant(tmp_path: Path, **dep_fields: Any) -> Path:
    dst = tmp_path / "p"
    shutil.copytree(POLICY, dst)
    path = dst / "deployments/pool-llama-8b.yaml"
    doc = yaml.safe_load(path.read_text())
    doc.update(dep_fields)
    path.write_text(yaml.safe_dump(doc))
    return dst


@pytest.mark.parametrize("fields", [{"withdrawn": True}, {"retire_at": "2020-01-01"}])
def test_withdrawn_or_retired_deployment_is_never_chosen(tmp_path: Path, fields: dict[str, Any]) -> None:
    snap = load_snapshot(_variant(tmp_path, **fields))
    ex = Exchange(snapshot=snap, cache_salts=SALTS, data_class="internal", identity=Identity("acme", "k", "api_key"),
                  route=snap.routes["chat-default"],
                  body={"model": "chat-default", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(GatewayError) as e:
        run(RouteSelection().run(ex))
    assert e.value.code is ErrorCode.NO_QUALIFIED_ROUTE and ex.cluster == ""


def test_data_class_not_served_by_candidate_is_no_qualified_route() -> None:
    ex = Exchange(snapshot=SNAP, cache_salts=SALTS, data_class="restricted", route=SNAP.routes["chat-default"],
                  body={"model": "chat-default", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(GatewayError) as e:
        run(RouteSelection().run(ex))
    assert e.value.code is ErrorCode.NO_QUALIFIED_ROUTE


def test_authorization_without_identity_fails_closed() -> None:
    ex = exchange({"model": "chat-default", "messages": [{"role": "user", "content": "x"}]}, tenant=None)
    assert code_of(ex, body_stages()) is ErrorCode.POLICY_UNAVAILABLE


def test_every_stage_is_timed() -> None:
    ex = exchange({"model": "chat-default", "messages": [{"role": "user", "content": "x"}]})
    run(run_stages(body_stages(), ex))
    assert list(ex.stage_us) == [s.name for s in body_stages()]


# -- the receive loop, with real ext_proc protobuf messages ----------------------------------------

def body_msg(body: bytes, path: str = "/v1/chat/completions", **hdrs: str) -> ep.ProcessingRequest:
    """What Envoy sends: the buffered body, the headers as CEL attributes."""
    attrs = struct_pb2.Struct()
    attrs.update({"request.id": "rid-1", "request.path": path, "request.method": "POST",
                  **{f"request.headers['{k}']": v for k, v in hdrs.items()}})
    req = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return req


def headers_msg(path: str, method: str = "GET", **hdrs: str) -> ep.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
          base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
          base_pb2.HeaderValue(key="x-request-id", raw_value=b"rid-2")]
    hv += [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs.items()]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv),
                                                               end_of_stream=True))


def converse(*msgs: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
    async def it() -> AsyncIterator[ep.ProcessingRequest]:
        for m in msgs:
            yield m

    async def main() -> list[ep.ProcessingResponse]:
        return [r async for r in Processor(Live(SNAP, SALTS), store=Store(valkey_url())).Process(it(), None)]  # type: ignore[arg-type]

    return run(main())


AUTH = {"authorization": "Bearer " + DEMO_KEYS["acme"]}
CHAT = json.dumps({"model": "chat-default", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_loop_admits_with_metadata_and_new_body() -> None:
    (resp,) = converse(body_msg(CHAT, **AUTH))
    assert resp.WhichOneof("response") == "request_body"
    common = resp.request_body.response
    assert common.clear_route_cache and common.HasField("header_mutation")  # Envoy needs both to re-route
    md = resp.dynamic_metadata.fields["io.llmgw"].struct_value.fields
    assert md["cluster"].string_value == "pool_engine-pool" and md["request_id"].string_value == "rid-1"
    assert md["tenant"].string_value == "acme" and md["route"].string_value == "chat-default"
    assert json.loads(common.body_mutation.body)["model"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_loop_refuses_unauthenticated() -> None:
    (resp,) = converse(body_msg(CHAT))
    imm = resp.immediate_response
    assert imm.status.code == 401 and imm.details == "llmgw_unauthenticated"
    assert json.loads(imm.body)["error"]["code"] == "unauthenticated"
    assert "cluster" not in resp.dynamic_metadata.fields["io.llmgw"].struct_value.fields


def test_loop_lists_models_from_headers() -> None:
    (resp,) = converse(headers_msg("/v1/models", **AUTH))
    doc = json.loads(resp.immediate_response.body)
    assert [m["id"] for m in doc["data"]] == ["chat-anthropic", "chat-bedrock", "chat-default", "chat-fallback",
                                             "chat-gemini", "embed-default"]
    (resp,) = converse(headers_msg("/v1/models"))
    assert resp.immediate_response.status.code == 401


def test_loop_refuses_other_header_only_requests() -> None:
    (resp,) = converse(headers_msg("/v1/other", **AUTH))
    assert resp.immediate_response.status.code == 404


def test_loop_turns_internal_errors_into_policy_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    async def boom(self: Any, ex: Exchange) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(RouteSelection, "run", boom)
    (resp,) = converse(body_msg(CHAT, **AUTH))
    assert resp.immediate_response.status.code == 503
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "policy_unavailable"


def test_demo_keys_are_made_per_state_dir_and_never_shipped(tmp_path: Path) -> None:
    """The committed policy holds no key; llmgw up makes one per tenant, stores its hash (marked demo)
    and keeps the key in the state dir (0600) for the next start; a new state dir gets new keys."""
    from llmgw.local.demo_keys import ensure_demo_keys

    # What git holds, not the working tree: a `make up` in this checkout writes keys.yaml (ignored by git).
    tracked = subprocess.run(["git", "ls-files", "policy"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "policy/keys.yaml" not in tracked.stdout.split()
    policy = tmp_path / "policy"
    shutil.copytree(EXAMPLE_POLICY, policy, ignore=shutil.ignore_patterns("keys.yaml", *EARNED))
    assert all(not t.api_keys for t in load_snapshot(policy).gateway.tenants.values())
    keys, made = ensure_demo_keys(policy, tmp_path / "state")
    assert set(made) == set(keys) == {"acme", "globex"}
    assert oct((tmp_path / "state" / "demo-keys.json").stat().st_mode & 0o777) == "0o600"
    snap = load_snapshot(policy)
    for tenant, key in keys.items():
        owner = snap.keys_by_hash[hashlib.sha256(key.encode()).hexdigest()]
        assert owner.tenant == tenant and owner.key.demo and owner.key.id == f"{tenant}-demo"
        assert key not in (policy / "keys.yaml").read_text()
    assert ensure_demo_keys(policy, tmp_path / "state") == (keys, [])  # the next start: the same keys
    again, made = ensure_demo_keys(policy, tmp_path / "other-state")
    assert set(made) == {"acme", "globex"} and set(again.values()).isdisjoint(keys.values())
    snap = load_snapshot(policy)
    assert all(hashlib.sha256(k.encode()).hexdigest() not in snap.keys_by_hash for k in keys.values())
    assert snap.demo_keys_exposed_on("127.0.0.1") == [] and snap.demo_keys_exposed_on("0.0.0.0") == [
        "acme-demo", "globex-demo"]


class RecordingStore(Store):
    """A store that records whether a reservation was asked for (and never answers one)."""

    def __init__(self) -> None:
        super().__init__(valkey_url())
        self.reserved = 0

    async def reserve(self, r: Any) -> Any:
        self.reserved += 1
        raise AssertionError("reserved")


@pytest.mark.parametrize(("waited_s", "reserves"), [
    (0.0, True), (SNAP.gateway.envoy.extproc_message_timeout_ms / 1000, False)])
def test_a_decision_envoy_stopped_waiting_for_reserves_nothing(waited_s: float, reserves: bool) -> None:
    """Issue 27, item 4: Envoy answers 503 itself once its message timeout passes; a reservation made
    after that would be held for a request no upstream sees, until its lease expired and charged it."""
    import time

    store = RecordingStore()
    ex = exchange({"model": "chat-default", "messages": [{"role": "user", "content": "hi"}]})
    ex.received_at = time.monotonic() - waited_s
    stages = build_stages(store=store)[1:]
    with pytest.raises((AssertionError, GatewayError)) as e:
        run(run_stages(stages, ex))
    assert store.reserved == (1 if reserves else 0)
    if not reserves:
        assert isinstance(e.value, GatewayError) and e.value.code is ErrorCode.POLICY_UNAVAILABLE
