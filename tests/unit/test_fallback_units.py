"""Fallback plans without Envoy: which composite clusters exist, which candidate an attempt goes to,
how attempts are told apart, and whose prices apply. The end-to-end proof is test_fallback_e2e."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import Snapshot, load_snapshot
from extproc.config.plans import attempt_kind, candidate_subsets, composite_name, decode_plan, encode_plan, sub_clusters
from extproc.contract import GatewayError
from extproc.service.attempts import body_for, choose_candidate
from extproc.settlement.charge import answered_by
from llmgw.local.procs import envoy_binary, envoy_env
from llmgw.render.bootstrap import RenderOptions, fallback_clusters, render_yaml
from tests.conftest import stamp_evidence
from tests.e2e.config.test_qualification import route, yaml_edit
from tests.e2e.routing.test_fallback_e2e import BACKUP, BACKUP_MODEL, fallback_policy
from tests.helpers import chat_body

FIRST = "pool-llama-8b"


@pytest.fixture(scope="module")
def snap(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    return load_snapshot(fallback_policy(tmp_path_factory.mktemp("fallback-units")))


def test_every_ordered_subset_of_two_or_more() -> None:
    assert list(candidate_subsets(1)) == []
    assert list(candidate_subsets(3)) == [(0, 1), (0, 2), (1, 2), (0, 1, 2)]
    assert list(candidate_subsets(2, [1])) == [(1,), (0, 1)]  # a credentialed candidate also alone
    assert sub_clusters(["a", "b"]) == ["a", "b", "b", "b", "b", "b"]  # then transport retries on the last
    assert len(list(candidate_subsets(5))) == 26
    assert composite_name("chat-default", (0, 2)) == "fallback_chat-default_0_2"


def test_plan_round_trip() -> None:
    assert decode_plan(encode_plan("acme", ["a", "b"])) == ("acme", ["a", "b"])
    assert decode_plan("") == ("", [])


def test_the_attempt_goes_to_the_candidate_of_its_host(snap: Snapshot) -> None:
    plan = [FIRST, BACKUP]
    assert choose_candidate(snap, plan, 1, "pool_engine-pool") == 0
    assert choose_candidate(snap, plan, 2, "pool_backup-pool") == 1
    # Candidate 1 had no healthy host: the composite sent attempt 1 to the next candidate.
    assert choose_candidate(snap, plan, 1, "pool_backup-pool") == 1
    assert choose_candidate(snap, plan, 3, "pool_backup-pool") == 1  # beyond the plan: the last again
    for attempt, host in ((2, "pool_engine-pool"), (1, "pool_elsewhere"), (1, "")):
        with pytest.raises(GatewayError) as e:  # never an earlier candidate again, never a stranger
            choose_candidate(snap, plan, attempt, host)
        assert e.value.code.value == "no_qualified_route"
    with pytest.raises(GatewayError):
        choose_candidate(snap, [FIRST], 1, "pool_backup-pool")  # not in this request's plan


def test_attempt_kinds(snap: Snapshot) -> None:
    first, backup = snap.deployments[FIRST], snap.deployments[BACKUP]
    assert attempt_kind(None, first) == "first"
    assert attempt_kind(first, first) == "transport_retry"
    assert attempt_kind(first, backup) == "model_fallback"
    same_model = first.model_copy(update={"deployment": "pool-llama-8b-eu2"})
    assert attempt_kind(first, same_model) == "provider_failover"


def test_the_body_is_addressed_to_the_candidate(snap: Snapshot) -> None:
    body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [], "cache_salt": "s"}).encode()
    assert body_for(body, snap.deployments[FIRST]) is None
    rewritten = json.loads(body_for(body, snap.deployments[BACKUP]) or b"")
    assert rewritten == {"model": BACKUP_MODEL, "messages": [], "cache_salt": "s"}


def test_prices_of_the_deployment_that_answered_only_if_the_plan_holds_it(snap: Snapshot) -> None:
    plan = encode_plan("acme", [FIRST, BACKUP])
    assert answered_by(snap, FIRST, plan, BACKUP) is snap.deployments[BACKUP]
    assert answered_by(snap, FIRST, plan, "") is snap.deployments[FIRST]
    assert answered_by(snap, FIRST, "", BACKUP) is snap.deployments[FIRST]  # no plan: an upstream's claim
    assert answered_by(snap, FIRST, encode_plan("acme", [FIRST]), BACKUP) is snap.deployments[FIRST]


def _rendered(snap: Snapshot) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.load(render_yaml(snap, RenderOptions.from_snapshot(snap)), Loader=yaml.CSafeLoader)
    return doc


def test_the_composite_cluster_holds_exactly_the_plan_and_runs_the_attempt_filter(snap: Snapshot) -> None:
    clusters = {c["name"]: c for c in _rendered(snap)["static_resources"]["clusters"]}
    composite = clusters["fallback_chat-default_0_1"]
    assert composite["cluster_type"]["name"] == "envoy.clusters.composite"
    assert [c["name"] for c in composite["cluster_type"]["typed_config"]["clusters"]] == [
        "pool_engine-pool", *["pool_backup-pool"] * 5]
    opts = composite["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert [f["name"] for f in opts["http_filters"]] == ["llmgw.attempt", "envoy.filters.http.upstream_codec"]
    attempt = opts["http_filters"][0]["typed_config"]
    assert not attempt.get("failure_mode_allow")  # fails closed (false is the default, left out)
    # The candidates' own clusters carry no attempt filter: single-candidate requests pay nothing.
    assert "http_filters" not in json.dumps(clusters["pool_engine-pool"])
    # Candidate 1 has a credential: alone, it goes through the attempt filter too (which injects it).
    assert [n for n in clusters if n.startswith("fallback_chat-default")] == ["fallback_chat-default_0",
                                                                                "fallback_chat-default_0_1"]
    assert {c["name"] for c in clusters["fallback_chat-default_0"]["cluster_type"]["typed_config"]["clusters"]} == {
        "pool_engine-pool"}


def test_rendered_fallback_config_passes_envoy_validate(snap: Snapshot, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(snap, RenderOptions.from_snapshot(snap)))
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)], env=envoy_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def _plan(policy: Path, data_class: str) -> tuple[list[str], str]:
    ex = route(policy, chat_body(max_tokens=4), data_class=data_class)
    return [d.deployment for d in ex.candidates], ex.cluster


def test_the_route_stage_plans_every_qualified_candidate_in_order(tmp_path: Path) -> None:
    policy = fallback_policy(tmp_path)
    assert _plan(policy, "internal") == ([FIRST, BACKUP], "fallback_chat-default_0_1")
    # Candidate 2 does not serve confidential data: a plan of candidate 1 alone (through the attempt
    # filter, which injects candidate 1's credential).
    assert _plan(policy, "confidential") == ([FIRST], "fallback_chat-default_0")


def test_fallback_off_plans_the_first_qualified_candidate_only(tmp_path: Path) -> None:
    policy = fallback_policy(tmp_path)
    yaml_edit(policy / "routes/chat-default.yaml", lambda doc: doc.update(fallback={"enabled": False}))
    stamp_evidence(policy, "pool-llama-8b", BACKUP)  # under the route's new fallback policy
    assert _plan(policy, "internal") == ([FIRST], "fallback_chat-default_0")
    # Envoy is given no composite of two or more for it: none can be routed to.
    assert [c.name for c in fallback_clusters(load_snapshot(policy), {"pool_engine-pool", "pool_backup-pool"})
            if c.name.startswith("fallback_chat-default")] == ["fallback_chat-default_0"]
    # Off, and without the credential: the candidate's own cluster, no attempt filter at all.
    yaml_edit(policy / "deployments/pool-llama-8b.yaml", lambda doc: doc.pop("credential_ref"))
    assert _plan(policy, "internal") == ([FIRST], "pool_engine-pool")


@pytest.mark.parametrize(("deployment", "names_shape"), [("pool-llama-8b", False), ("demo-anthropic", True)])
def test_only_the_attempt_filter_names_an_answers_shape(deployment: str, names_shape: bool) -> None:
    """A translated candidate's 2xx is named for the Lua answer filter; any other answer has those
    names removed, so an upstream's own headers of those names cannot choose a translation."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.config.plans import translated
    from extproc.names import Header
    from extproc.service.attempts import _Attempt
    from extproc.shapes.registry import adapter_for
    from tests.conftest import POLICY

    snap = load_snapshot(POLICY)
    dep = snap.deployments[deployment]
    state = _Attempt(snap, dep=dep, adapter=adapter_for(dep.fingerprint.adapter) if translated(dep) else None)
    req = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    reply = state.answer(req)
    assert reply is not None
    mutation = reply.response_headers.response.header_mutation
    named = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert (named.get(Header.ANSWER_SHAPE) == "anthropic") == names_shape
    assert (Header.ANSWER_SHAPE in mutation.remove_headers) == (not names_shape)
    # Nor can an upstream's own header pass its answer off as the attempt filter's refusal.
    assert Header.ATTEMPT_REFUSED in mutation.remove_headers


def test_an_attempt_is_in_the_store_as_it_starts(snap: Snapshot) -> None:
    """An attempt that times out is recorded (status 0) while its stream is still open: Envoy closes an
    abandoned attempt's stream when it gets to it, on a loaded machine after the next attempt has
    answered and the request was settled, and the ledger lost the attempt."""
    import asyncio

    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf import struct_pb2

    from extproc.names import HOST_CLUSTER, Filter, Key, metadata_path
    from extproc.service.attempts import AttemptFilter

    class Store:
        def __init__(self) -> None:
            self.records: list[tuple[str, str, int, dict[str, Any]]] = []

        async def record_attempt(self, tenant: str, rid: str, n: int, record: dict[str, Any], hint: str = "") -> None:
            self.records.append((tenant, rid, n, record))

    attrs = struct_pb2.Struct()
    attrs.update({metadata_path(Key.PLAN): encode_plan("acme", [FIRST, BACKUP]), HOST_CLUSTER: "pool_engine-pool",
                  "request.id": "r-1"})
    first = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key="x-envoy-attempt-count", raw_value=b"1")])),
        attributes={Filter.EXT_PROC: attrs})

    async def open_stream() -> Any:  # the attempt's stream: nothing after its headers, never closed
        await asyncio.Event().wait()
        yield ep.ProcessingRequest()

    async def scenario() -> list[tuple[str, str, int, dict[str, Any]]]:
        store = Store()

        class Live:
            snapshot = snap
            credentials = dict.fromkeys(snap.deployments, "key")
            credential_errors: dict[str, str] = {}

        replies = AttemptFilter(store, lambda: Live).handle(first, open_stream())  # type: ignore[arg-type]
        await anext(replies)  # the request headers answered: the attempt is on its way upstream
        await asyncio.sleep(0)  # the queued write runs
        recorded = list(store.records)  # while the attempt's stream is still open
        await replies.aclose()
        return recorded

    records = asyncio.run(scenario())
    assert records and records[0][:3] == ("acme", "r-1", 1)
    assert {k: records[0][3][k] for k in ("n", "deployment", "status")} == {"n": 1, "deployment": FIRST, "status": 0}


def test_a_fallback_attempt_takes_from_its_candidates_provider_quota_before_it_is_sent() -> None:
    """The decision reserved the pool's slot; the fallback to the hosted candidate takes from that
    candidate's provider quota as it starts (a real store). A token bound the quota cannot hold this
    minute refuses the attempt 429 `overloaded` with retry-after, recorded; a quota the decision
    already took for this candidate is not taken twice."""
    import asyncio

    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from google.protobuf import struct_pb2

    from extproc.names import HOST_CLUSTER, Filter, Key, metadata_path
    from extproc.service.attempts import AttemptFilter
    from extproc.store import Store, quota_key
    from tests.conftest import POLICY, valkey_url

    snap = load_snapshot(POLICY)
    hosted = "demo-anthropic"
    assert snap.deployments[hosted].provider_quota is not None

    def attempt(hint: dict[str, Any]) -> ep.ProcessingRequest:
        attrs = struct_pb2.Struct()
        attrs.update({metadata_path(Key.PLAN): encode_plan("acme", [FIRST, hosted]), HOST_CLUSTER: f"dep_{hosted}",
                      metadata_path(Key.HOLD): json.dumps(hint), "request.id": f"r-{len(json.dumps(hint))}"})
        return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key="x-envoy-attempt-count", raw_value=b"2")])), attributes={Filter.EXT_PROC: attrs})

    async def nothing() -> Any:
        await asyncio.Event().wait()
        yield ep.ProcessingRequest()

    class Live:
        snapshot = snap
        credentials = dict.fromkeys(snap.deployments, "key")
        credential_errors: dict[str, str] = {}

    async def first_reply(hint: dict[str, Any]) -> tuple[ep.ProcessingResponse, int]:
        store = Store(valkey_url())
        try:
            before = await store.client.exists(quota_key(hosted, "rpm"))
            replies = AttemptFilter(store, lambda: Live).handle(attempt(hint), nothing())  # type: ignore[arg-type]
            reply = await anext(replies)
            await replies.aclose()
            return reply, before
        finally:
            await store.close()

    spent, _ = asyncio.run(first_reply({"p": 10, "t": 3_000_000}))  # more than the minute's 2M tokens
    assert spent.immediate_response.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in spent.immediate_response.headers.set_headers}
    assert int(headers["retry-after"]) >= 1 and b"overloaded" in spent.immediate_response.body
    sent, _ = asyncio.run(first_reply({"p": 10, "t": 100}))
    assert sent.HasField("request_headers")  # on its way, its quota taken
    taken = asyncio.run(first_reply({"p": 10, "t": 100}))[1]
    assert taken == 1  # the earlier attempt's request is in the candidate's bucket
    held = {"p": 10, "t": 3_000_000, "q": [[quota_key(hosted, "rpm"), 15.0, 1, False]]}
    assert asyncio.run(first_reply(held))[0].HasField("request_headers")  # admission took it: not again
