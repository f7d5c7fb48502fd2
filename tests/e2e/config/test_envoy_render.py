"""The rendered Envoy bootstrap: valid for the real Envoy binary, and wired to fail closed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_snapshot
from extproc.config.schema import MAX_RETRIES
from extproc.contract import ErrorCode, GatewayError
from extproc.names import EXTPROC_CLUSTER
from extproc.shapes.registry import DOORS, DOORS_BY_NAME
from llmgw.local.procs import envoy_binary, envoy_env, free_port, wait_until
from llmgw.render.bootstrap import RenderOptions, render_yaml
from llmgw.render.routes import direct_clusters, translating_composites
from tests.conftest import POLICY
from tests.helpers import request


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    snap = load_snapshot(POLICY)
    return yaml.load(render_yaml(snap, RenderOptions.from_snapshot(snap)), Loader=yaml.CSafeLoader)


def hcm(doc: dict[str, Any]) -> dict[str, Any]:
    (listener,) = doc["static_resources"]["listeners"]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def filters(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f["typed_config"] for f in hcm(doc)["http_filters"]}


def test_envoy_binary_runs() -> None:
    out = subprocess.run([str(envoy_binary()), "--version"], env=envoy_env(), capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "/1.40." in out.stdout


def test_rendered_config_passes_envoy_validate(tmp_path: Path) -> None:
    snap = load_snapshot(POLICY)
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(snap, RenderOptions.from_snapshot(snap)))
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)], env=envoy_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK" in out.stdout


def test_ext_proc_fails_closed_with_one_message(rendered: dict[str, Any]) -> None:
    ep = filters(rendered)["envoy.filters.http.ext_proc"]
    assert ep.get("failure_mode_allow", False) is False
    assert ep["processing_mode"]["request_header_mode"] == "SKIP"
    assert ep["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert "request.headers['authorization']" in ep["request_attributes"]
    assert ep["mutation_rules"]["allow_envoy"] is True
    assert ep["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER


def test_filter_order(rendered: dict[str, Any]) -> None:
    # The buffer filter after ext_proc holds the headers until ext_proc has decided on the body:
    # with header mode SKIP the router would otherwise route (and dispatch) before the decision.
    # The upstream-headers mutation runs after the buffer, when ext_proc's metadata is set. The meter
    # and the stream guard sit after the buffer: they read their per-route switches on the route the
    # decision selected. The Lua door filter comes before the decision filter: on the way out it runs
    # last, after everything that reads the internal shape, and sees ext_proc's own refusals too.
    assert list(filters(rendered)) == [
        "envoy.filters.http.header_mutation", "llmgw.lua_doors", "envoy.filters.http.ext_proc",
        "envoy.filters.http.buffer",
        "llmgw.meter", "llmgw.streams", "llmgw.lua_streams", "envoy.filters.http.json_to_metadata",
        # The Lua answer filter after the allow-list (it sets a translated request's headers) and
        # nearer the router than json_to_metadata (it translates the answer before its usage is read).
        "llmgw.upstream_headers", "llmgw.lua_answers", "envoy.filters.http.custom_response",
        # Nearest the router: the upstream's own status, before anything above replaces the answer.
        "llmgw.upstream_status", "envoy.filters.http.router"]


def test_response_filters_are_off_unless_a_chat_route_turns_them_on(rendered: dict[str, Any]) -> None:
    chain = {f["name"]: f for f in hcm(rendered)["http_filters"]}
    assert chain["llmgw.meter"]["disabled"] is True and chain["llmgw.streams"]["disabled"] is True
    assert chain["llmgw.lua_doors"]["disabled"] is True
    assert "default_source_code" not in chain["llmgw.lua_doors"]["typed_config"]  # a door's routes name it
    routes = {r["name"]: r for r in hcm(rendered)["route_config"]["virtual_hosts"][0]["routes"]}
    # The door filter is on only for a front door's paths (its requests and its token counts), its
    # door's admitted routes and the token counts' routes (and the response filters with it), running
    # the door script.
    counts = [r for r in routes.values() if r["name"].startswith("admitted_") and r["name"].endswith("_count")]
    assert {r["route"]["cluster"] for r in counts} == {"pool_engine-pool", "dep_demo-anthropic", "dep_demo-bedrock",
                                                       "dep_demo-gemini"}
    names = tuple(DOORS_BY_NAME)
    assert set(names) == {"anthropic", "gemini", "responses"}
    for name in names:
        door = routes[f"{name}_without_body"]
        assert door["match"] == {"safe_regex": {"regex": DOORS_BY_NAME[name].path}}
        own = [door]
        if DOORS_BY_NAME[name].count_path:  # (the Responses door counts nothing)
            own.append(routes[f"{name}_without_body_count"])
            assert own[-1]["match"] == {"safe_regex": {"regex": DOORS_BY_NAME[name].count_path}}
        admitted = [r for r in routes.values()
                    if r["name"].startswith("admitted_") and r["name"].endswith(f"_{name}")]
        assert admitted
        for r in (*own, *admitted, *counts):
            on = r["typed_per_filter_config"]["llmgw.lua_doors"]
            assert not on.get("disabled", False) and on["config"]["name"] == "doors", r["name"]
    assert not [r["name"] for r in routes.values() if "llmgw.lua_doors" in r.get("typed_per_filter_config", {})
                and not r["name"].endswith(tuple(f"_{n}" for n in names))
                and r not in counts and not r["name"].startswith(tuple(f"{n}_without_body" for n in names))]
    on = routes["chat_without_body"]["typed_per_filter_config"]
    assert {"llmgw.meter", "llmgw.streams", "llmgw.lua_streams", "llmgw.lua_answers"} <= set(on)
    assert all(not on[f].get("disabled", False) for f in ("llmgw.meter", "llmgw.streams", "llmgw.lua_streams"))
    # The Lua guard's script is off on the route that turns its filter on: it runs on the stream route.
    assert on["llmgw.lua_streams"]["config"]["disabled"] is True
    assert chain["llmgw.lua_streams"]["disabled"] is True
    meter = filters(rendered)["llmgw.meter"]
    assert "observability_mode" not in meter and meter["failure_mode_allow"] is True  # blocking, fails open
    pm = meter["processing_mode"]
    assert pm["request_header_mode"] == "SKIP" and pm["response_header_mode"] == "SKIP"
    assert pm["response_body_mode"] == "STREAMED"
    assert "metadata.filter_metadata['io.llmgw']['tenant']" in meter["response_attributes"]


def test_every_admitted_request_reaches_the_settlement_log(rendered: dict[str, Any]) -> None:
    (als,) = [a for a in hcm(rendered)["access_log"] if a["name"] == "envoy.access_loggers.http_grpc"]
    holds, unprocessed = als["filter"]["or_filter"]["filters"]
    matcher = holds["metadata_filter"]["matcher"]
    assert matcher["path"] == [{"key": "settle"}] and matcher["value"] == {"present_match": True}
    # ... and every request Envoy answered because no decision reached it (issue 27, item 4).
    assert unprocessed["extension_filter"]["typed_config"]["expression"] == \
        "response.code_details.startsWith('ext_proc')"
    rules = filters(rendered)["envoy.filters.http.json_to_metadata"]["response_rules"]["rules"]
    assert [[s["key"] for s in r["selectors"]] for r in rules] == [
        ["usage", "prompt_tokens"], ["usage", "completion_tokens"], ["usage", "prompt_tokens_details", "cached_tokens"],
        # the classes priced apart (cache writes by TTL, reasoning)
        ["usage", "prompt_tokens_details", "cache_write_tokens"],
        ["usage", "prompt_tokens_details", "cache_write_1h_tokens"],
        ["usage", "completion_tokens_details", "reasoning_tokens"],
        ["id"], ["model"]]  # the upstream's own id for its answer and its model, for the attempt's ledger record


def test_upstream_routes_require_extproc_metadata(rendered: dict[str, Any]) -> None:
    translated_here = direct_clusters(load_snapshot(POLICY))
    assert set(translated_here) == {"dep_demo-anthropic", "dep_demo-gemini", "dep_demo-bedrock"}
    assert "x-api-key" in translated_here["dep_demo-anthropic"]
    assert "authorization" in translated_here["dep_demo-bedrock"]
    streamed_here = translated_here  # each shape's stream is read in Lua too
    routes = hcm(rendered)["route_config"]["virtual_hosts"][0]["routes"]
    to_clusters = [r for r in routes if "route" in r]
    composites_translating = translating_composites(load_snapshot(POLICY), {r["route"]["cluster"] for r in to_clusters})
    assert composites_translating and all(c.startswith("fallback_") for c in composites_translating)
    assert to_clusters, "no route reaches an upstream"
    # A door's token count, per cluster whose deployment counts: the Lua answer filter on (it sets the
    # count's path and headers, which the router must keep), no path rewrite, no guard.
    counts = [r for r in to_clusters if r["name"].endswith("_count")]
    for r in counts:
        cluster = r["route"]["cluster"]
        assert r["name"] == f"admitted_{cluster}_count" and r["match"]["prefix"] == "/"
        assert r["match"]["dynamic_metadata"] == [
            {"filter": "io.llmgw", "path": [{"key": "cluster"}], "value": {"string_match": {"exact": cluster}}},
            {"filter": "io.llmgw", "path": [{"key": "count"}], "value": {"present_match": True}}]
        assert "regex_rewrite" not in r["route"] and "llmgw.lua_answers" not in r["typed_per_filter_config"]
        assert r["request_headers_to_remove"] == [h for h in ("authorization", "x-api-key", "x-goog-api-key")
                                                  if h not in translated_here.get(cluster, ())]
        assert {"llmgw.meter", "llmgw.streams", "llmgw.lua_streams"} <= set(r["typed_per_filter_config"])
    for r in (r for r in to_clusters if r not in counts):
        md = r["match"]["dynamic_metadata"][0]
        assert md["filter"] == "io.llmgw" and md["path"] == [{"key": "cluster"}]
        assert md["value"]["string_match"]["exact"] == r["route"]["cluster"]
        # The Lua answer filter runs on the JSON route of a deployment the decision translates for,
        # and on its stream route where the filter reads that shape's streams (extproc/direct.py);
        # there the router keeps what the filter sets (its key among them). It also runs on every
        # route to a composite cluster of a route with a candidate of another shape: the attempt
        # filter names such a candidate's answer, which no ext_proc filter reads (issue 27).
        answers = "llmgw.lua_answers" not in r.get("typed_per_filter_config", {})
        cluster = r["route"]["cluster"]
        shape = (translated_here if r["name"] in (f"admitted_{cluster}", f"admitted_{cluster}_checked") else
                 streamed_here if r["name"] in (f"admitted_{cluster}_stream", f"admitted_{cluster}_checked_stream")
                 else {}).get(cluster)
        # ... and on a pool's JSON routes: every pool JSON answer is checked to be a chat completion (issue 31).
        pool_json = cluster.startswith("pool_") and "settle" not in json.dumps(r["match"]["dynamic_metadata"])
        assert answers == (shape is not None or cluster in composites_translating or pool_json), r["name"]
        assert r["request_headers_to_remove"] == [h for h in ("authorization", "x-api-key", "x-goog-api-key")
                                                  if h not in (shape or ())]
        # Streams: the Lua stream guard. Idempotent streams: ext_proc's stream guard. Idempotent JSON:
        # the meter. Other JSON: none of them (the access log settles).
        extra = r["match"]["dynamic_metadata"][1:]
        settles = [(m["path"][0]["key"], m["value"]["string_match"]["exact"]) for m in extra
                   if m["path"][0]["key"] != "door"]
        assert settles in ([], [("settle", "stream")], [("settle", "kept_stream")], [("settle", "metered")],
                           [("settle", "checked")], [("settle", "checked_stream")])
        kind = settles[0][1] if settles else ""
        if kind in ("stream", "kept_stream", "checked_stream"):
            # Each attempt's silence is bounded by the per-try idle timer; the route's own, which a
            # retry does not reset, sits above all attempts' so a silent attempt can still fall back.
            per_try = float(r["route"]["retry_policy"]["per_try_idle_timeout"].rstrip("s"))
            assert float(r["route"]["idle_timeout"].rstrip("s")) >= per_try * (MAX_RETRIES + 1)
        door = next((d for d in DOORS if r["name"].endswith(f"_{d.name}")), None)  # a front door's path
        assert r["name"] == f"admitted_{r['route']['cluster']}" + (f"_{kind}" if kind else "") + (
            f"_{door.name}" if door else "")
        if door is not None:  # by the decision's door; rewritten: the request is a chat completion now
            assert r["match"]["prefix"] == "/" and "safe_regex" not in r["match"]
            assert extra[-1] == {"filter": "io.llmgw", "path": [{"key": "door"}],
                                 "value": {"string_match": {"exact": door.name}}}
            assert r["route"]["regex_rewrite"] == {"pattern": {"regex": "^.*$"},
                                                   "substitution": "/v1/chat/completions"}
        else:
            assert r["match"]["prefix"] == "/v1/" and "regex_rewrite" not in r["route"]
        guards = {"llmgw.meter", "llmgw.streams", "llmgw.lua_streams"}
        on = {"stream": "llmgw.lua_streams", "kept_stream": "llmgw.streams", "metered": "llmgw.meter", "": None,
              "checked_stream": "llmgw.streams", "checked": "llmgw.meter"}
        # A JSON answer passes the Lua guard's script too: it names the route as the answer's model.
        json_answer = {"llmgw.lua_streams"} if kind in ("", "metered", "checked") else set()
        per_filter = r.get("typed_per_filter_config", {})
        off = {g for g in set(per_filter) & guards if per_filter[g].get("disabled")}
        assert off == guards - {on[kind]} - json_answer, (kind, off)
        if kind.startswith("checked"):
            # A checked answer's filter fails closed; a JSON one holds the answer whole, headers too.
            overrides = per_filter[on[kind]]["overrides"]
            assert overrides["failure_mode_allow"] is False
            mode = overrides.get("processing_mode", {})
            assert (mode.get("response_header_mode"), mode.get("response_body_mode")) == (
                ("SEND", "BUFFERED") if kind == "checked" else (None, None))
    assert {r["name"].removeprefix("admitted_pool_engine-pool") for r in to_clusters} >= {
        "", "_stream", "_kept_stream", "_metered", "_anthropic", "_stream_anthropic", "_gemini", "_stream_gemini",
        "_checked", "_checked_stream", "_checked_anthropic", "_checked_stream_gemini"}
    # Everything else is answered by Envoy itself in the contract's JSON; a front door's request
    # without a body in its door's shape (issue 27), with the same code inside.
    for r in routes:
        if "direct_response" in r and r["direct_response"]["status"] >= 400:
            body = yaml.safe_load(r["direct_response"]["body"]["inline_string"])
            door = next((d for d in DOORS if r["name"].startswith((f"{d.name}_without_body", f"{d.name}_models"))),
                        None)
            if door is None:
                assert set(body["error"]) == {"message", "type", "code", "param"}
                continue
            models = r["name"] == f"{door.name}_models"  # a door's own model paths: never reached, ext_proc answers
            contract = GatewayError(ErrorCode.POLICY_UNAVAILABLE, "the model list is unavailable").body() if models \
                else GatewayError(ErrorCode.INVALID_REQUEST, "a JSON request body is required").body()
            assert body == json.loads(door.error(r["direct_response"]["status"], contract)), r["name"]


def test_admin_on_loopback_and_extproc_breakers_raised(rendered: dict[str, Any]) -> None:
    assert rendered["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    (ext,) = [c for c in rendered["static_resources"]["clusters"] if c["name"] == EXTPROC_CLUSTER]
    thresholds = ext["circuit_breakers"]["thresholds"][0]
    assert thresholds["max_requests"] >= 100_000
    opts = ext["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]


def test_pool_cluster_health_checked(rendered: dict[str, Any]) -> None:
    (pool,) = [c for c in rendered["static_resources"]["clusters"] if c["name"] == "pool_engine-pool"]
    assert pool["health_checks"][0]["http_health_check"]["path"] == "/health"
    lb_endpoints = pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    hosts = [e["endpoint"]["address"]["socket_address"] for e in lb_endpoints]
    assert [(h["address"], h["port_value"]) for h in hosts] == [("127.0.0.1", 8101), ("127.0.0.1", 8102)]


def test_every_local_reply_is_contract_json(rendered: dict[str, Any]) -> None:
    """In the contract's shape, or - for a front door's request, matched by its path first - in the
    door's, with the same code inside."""
    mappers = hcm(rendered)["local_reply_config"]["mappers"]
    assert any("ext_proc" in m["filter"]["extension_filter"]["typed_config"]["expression"] for m in mappers)
    plain = [m for m in mappers if "x-envoy-original-path" not in m["filter"]["extension_filter"]["typed_config"][
        "expression"]]

    def body(m: dict[str, Any]) -> Any:  # text, not json_format: Google's integer code stays one
        return json.loads(m["body_format_override"]["text_format_source"]["inline_string"].replace("%%", "%"))
    for m in plain:
        assert set(body(m)["error"]) == {"message", "type", "code", "param"}
    assert mappers[-len(plain):] == plain  # the doors' mappers come first: the first match wins
    for door in DOORS:
        mine = [m for m in mappers if door.path in m["filter"]["extension_filter"]["typed_config"]["expression"]]
        assert len(mine) == len(plain)
        for m, p in zip(mine, plain, strict=True):
            # the door's shape of the same error, chosen by the decision's door once there is one
            assert f"['door'] == '{door.name}'" in m["filter"]["extension_filter"]["typed_config"]["expression"]
            assert body(m) == json.loads(door.error(m["status_code"], json.dumps(body(p)).encode()))


def test_render_cli_writes_file(tmp_path: Path) -> None:
    from llmgw.cli import main

    out = tmp_path / "envoy.yaml"
    with pytest.raises(SystemExit) as done:
        main(["envoy", "render", "--config", str(POLICY), "-o", str(out)])
    assert done.value.code == 0
    doc = yaml.load(out.read_text(), Loader=yaml.CSafeLoader)
    assert doc["static_resources"]["listeners"][0]["name"] == "llmgw"


def test_pool_uses_override_host_from_picker_metadata(rendered: dict[str, Any]) -> None:
    (pool,) = [c for c in rendered["static_resources"]["clusters"] if c["name"] == "pool_engine-pool"]
    (policy,) = pool["load_balancing_policy"]["policies"]
    cfg = policy["typed_extension_config"]
    assert cfg["name"] == "envoy.load_balancing_policies.override_host"
    (source,) = cfg["typed_config"]["override_host_sources"]
    assert source == {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    fallback = cfg["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]["name"]
    assert fallback == "envoy.load_balancing_policies.least_request"


def test_round_robin_baseline_has_no_override() -> None:
    snap = load_snapshot(POLICY)
    opts = RenderOptions.from_snapshot(snap, pool_lb="round_robin")
    doc = yaml.load(render_yaml(snap, opts), Loader=yaml.CSafeLoader)
    (pool,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "pool_engine-pool"]
    # ROUND_ROBIN is the enum default, which the JSON render omits.
    assert pool.get("lb_policy", "ROUND_ROBIN") == "ROUND_ROBIN" and "load_balancing_policy" not in pool


def test_downstream_connections_are_bounded(rendered: dict[str, Any]) -> None:
    (monitor,) = rendered["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == "10000"


def test_the_stats_listener_serves_envoys_metrics_and_nothing_else_of_admin(tmp_path: Path) -> None:
    """docker-compose's Prometheus reads Envoy's /stats/prometheus on its own listener; the admin
    interface stays on loopback and none of its other paths is reachable through it."""
    snap = load_snapshot(POLICY)
    listen, admin, stats = free_port(), free_port(), free_port()
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(snap, RenderOptions.from_snapshot(
        snap, listen=("127.0.0.1", listen), admin=("127.0.0.1", admin), stats_listen=("127.0.0.1", stats))))
    assert RenderOptions.for_compose(snap).stats_listen == ("0.0.0.0", 9902)
    proc = subprocess.Popen([str(envoy_binary()), "-c", str(path), "--base-id", str(stats)], env=envoy_env(),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "envoy.log", "wb"))  # noqa: SIM115
    try:
        base = f"http://127.0.0.1:{stats}"
        wait_until(lambda: request(f"{base}/stats/prometheus").status == 200, 30, "envoy stats listener")
        page = request(f"{base}/stats/prometheus").body.decode()
        assert "envoy_cluster_upstream_rq_total" in page or "envoy_server_live" in page
        for method, probe in (("GET", "/quitquitquit"), ("POST", "/quitquitquit"), ("POST", "/stats/prometheus"),
                              ("GET", "/config_dump"), ("GET", "/stats/prometheus/../config_dump")):
            assert request(f"{base}{probe}", method).status == 404, (method, probe)
        assert proc.poll() is None  # still running: /quitquitquit never reached the admin interface
        assert request(f"http://127.0.0.1:{admin}/ready").status == 200
    finally:
        proc.terminate()
        proc.wait(10)
