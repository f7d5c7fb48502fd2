"""The mesh manifests (`llmgw envoy render --target istio|envoy-gateway`, llmgw/render/mesh.py): their
Kubernetes resources validate against Kubernetes' schemas (kubernetes-validate) and their custom
resources against the Istio and Envoy Gateway CRDs' schemas (compiled by kubernetes-models, run by
Node.js: deploy/mesh/validate.mjs); and their patches, applied to a mesh-like Envoy configuration the
way each control plane applies them, give a configuration Envoy 1.40 accepts, with the gateway's
filters, routes and clusters in place."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from extproc.config import load_snapshot
from llmgw.local.procs import envoy_binary, envoy_env
from llmgw.render.mesh import HCM, HCM_TYPE, ROUTER, MeshTarget, manifests_yaml, render_manifests
from tests.conftest import POLICY

ROOT = Path(__file__).resolve().parents[3]
VALIDATOR = ROOT / "deploy/mesh/validate.mjs"
SNAP = load_snapshot(POLICY)
TARGET = MeshTarget()
K8S_VERSION = "1.33"
ENVOY_TYPES = "type.googleapis.com/envoy.extensions"


@functools.cache
def _rendered(kind: str) -> str:
    return json.dumps(render_manifests(SNAP, kind, TARGET))


def manifests(kind: str) -> list[dict[str, Any]]:
    """The manifests for `kind`, rendered once per test session (each caller gets its own copy)."""
    docs: list[dict[str, Any]] = json.loads(_rendered(kind))
    return docs


def crd_check(docs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    custom = [d for d in docs if d["apiVersion"] != "v1"]
    return subprocess.run(["node", str(VALIDATOR)], input=json.dumps(custom), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("kind", ["istio", "envoy-gateway"])
def test_the_manifests_validate_against_their_schemas(kind: str) -> None:
    docs = manifests(kind)
    for doc in (d for d in docs if d["apiVersion"] == "v1"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    out = crd_check(docs)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": valid") == len([d for d in docs if d["apiVersion"] != "v1"]) >= 1


def test_the_validators_refuse_what_their_schemas_refuse() -> None:
    istio = manifests("istio")
    eg = manifests("envoy-gateway")
    bad_filter = copy.deepcopy(istio[-1])
    bad_filter["spec"]["configPatches"][0]["applyTo"] = "HTTP_FILTERS"
    bad_policy = copy.deepcopy(eg[-1])
    bad_policy["spec"]["type"] = "StrategicMerge"
    for bad in (bad_filter, bad_policy):
        out = crd_check([bad])
        assert out.returncode == 1 and "INVALID" in out.stdout, out.stdout + out.stderr
    service = copy.deepcopy(istio[0])
    service["spec"]["ports"][0]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)


def _typed(name: str, type_url: str) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": type_url}}


def mesh_listener(name: str, chain_key: str) -> dict[str, Any]:
    """A listener as a mesh renders one: its HCM with a filter of its own before the router, and an app's
    route."""
    hcm = {"@type": HCM_TYPE, "stat_prefix": "mesh",
           "route_config": {"name": "mesh", "virtual_hosts": [{"name": "app", "domains": ["*"], "routes": [
               {"name": "app", "match": {"prefix": "/app"}, "route": {"cluster": "app"}}]}]},
           "http_filters": [_typed("envoy.filters.http.cors", f"{ENVOY_TYPES}.filters.http.cors.v3.Cors"),
                            _typed(ROUTER, f"{ENVOY_TYPES}.filters.http.router.v3.Router")]}
    chain = {"filters": [{"name": HCM, "typed_config": hcm}]}
    return {"name": name, "address": {"socket_address": {"address": "0.0.0.0", "port_value": TARGET.listen_port}},
            chain_key: [chain] if chain_key == "filter_chains" else chain}


def mesh_bootstrap(listener: dict[str, Any]) -> dict[str, Any]:
    app = {"name": "app", "type": "STATIC", "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9}}}}]}]}}
    return {"node": {"id": "mesh", "cluster": "mesh"}, "static_resources": {"listeners": [listener], "clusters": [app]}}


def merged(into: Any, value: Any) -> Any:
    """Protobuf merge, as Istio's MERGE does it: messages field by field, repeated fields appended."""
    if isinstance(into, dict) and isinstance(value, dict):
        return {**into, **{k: merged(into[k], v) if k in into else v for k, v in value.items()}}
    if isinstance(into, list) and isinstance(value, list):
        return into + value
    return value


def apply_envoy_filter(boot: dict[str, Any], envoy_filter: dict[str, Any]) -> dict[str, Any]:
    """Each config patch as Istio applies it to the proxies its context names (one listener here)."""
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    for p in envoy_filter["spec"]["configPatches"]:
        op, value = p["patch"]["operation"], p["patch"]["value"]
        match p["applyTo"], op:
            case "HTTP_FILTER", "INSERT_BEFORE":
                at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == ROUTER)
                hcm["http_filters"].insert(at, value)
            case "HTTP_FILTER", "MERGE":
                (router,) = [f for f in hcm["http_filters"] if f["name"] == p["match"]["listener"]["filterChain"][
                    "filter"]["subFilter"]["name"]]
                assert value["typed_config"]["@type"] == router["typed_config"]["@type"]
                router.update(merged(router, value))
            case "NETWORK_FILTER", "MERGE":
                assert value["typed_config"]["@type"] == hcm["@type"]
                hcm.update(merged(hcm, value["typed_config"]))
            case "VIRTUAL_HOST", "MERGE":
                vhost.update(merged(vhost, value))
            case "HTTP_ROUTE", "INSERT_FIRST":
                vhost["routes"].insert(0, value)
            case "CLUSTER", "ADD":
                boot["static_resources"]["clusters"].append(value)
            case "BOOTSTRAP", "MERGE":
                boot.update(merged(boot, value))
            case other:
                raise AssertionError(f"patch not emulated here: {other}")
    return boot


def apply_envoy_gateway(proxy: dict[str, Any], policy: dict[str, Any]) -> dict[str, Any]:
    """Envoy Gateway's JSON patches on the resources it generated, by type and name: the listener (its
    HCM in `default_filter_chain`), its route configuration (RDS there; inline here to validate) and
    new clusters (a whole-resource add); and the EnvoyProxy's bootstrap merged into the bootstrap."""
    name = f"{TARGET.namespace}/{TARGET.gateway}/{TARGET.listener}"
    listener = mesh_listener(name, "default_filter_chain")
    routes = listener["default_filter_chain"]["filters"][0]["typed_config"].pop("route_config")
    resources: dict[tuple[str, str], Any] = {("Listener", name): listener, ("RouteConfiguration", name): routes}
    clusters = []
    for p in policy["spec"]["jsonPatches"]:
        kind = p["type"].rsplit(".", 1)[1]
        if kind == "Cluster" and p["operation"]["path"] == "":
            clusters.append(p["operation"]["value"])
            continue
        operation = dict(p["operation"])
        if found := operation.pop("jsonPath", None):  # the one form the policy uses: a filter found by name
            chain, name_is = found.split("[?(@.name=='")
            filter_name, rest = name_is.split("')]")
            assert chain == "$.default_filter_chain.filters[0].typed_config.http_filters", found
            filters = resources[(kind, p["name"])]["default_filter_chain"]["filters"][0]["typed_config"]["http_filters"]
            at = next(i for i, f in enumerate(filters) if f["name"] == filter_name)
            operation["path"] = (f"/default_filter_chain/filters/0/typed_config/http_filters/{at}"
                                 f"{rest.replace('.', '/')}{operation['path']}")
        resources[(kind, p["name"])] = jsonpatch.apply_patch(resources[(kind, p["name"])], [operation], in_place=True)
    listener = resources[("Listener", name)]
    hcm = listener["default_filter_chain"]["filters"][0]["typed_config"]
    hcm["route_config"] = resources[("RouteConfiguration", name)]
    boot = mesh_bootstrap(listener)
    boot["static_resources"]["clusters"] += clusters
    assert proxy["spec"]["bootstrap"]["type"] == "Merge"
    return dict(merged(boot, yaml.safe_load(proxy["spec"]["bootstrap"]["value"])))


def envoy_accepts(boot: dict[str, Any], tmp: Path) -> None:
    path = tmp / "envoy.yaml"
    path.write_text(yaml.safe_dump(boot))
    out = subprocess.run([str(envoy_binary()), "--mode", "validate", "-c", str(path)], env=envoy_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]


@pytest.mark.parametrize("kind", ["istio", "envoy-gateway"])
def test_the_patches_applied_give_a_config_envoy_accepts_with_the_gateway_in_place(kind: str, tmp_path: Path) -> None:
    docs = manifests(kind)
    if kind == "istio":
        boot = apply_envoy_filter(mesh_bootstrap(mesh_listener("mesh", "filter_chains")), docs[-1])
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    else:
        boot = apply_envoy_gateway(docs[-2], docs[-1])
        hcm = boot["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    envoy_accepts(boot, tmp_path)
    names = [f["name"] for f in hcm["http_filters"]]
    # The decision filter, then the buffer that holds the headers until it decided, before the router.
    assert names.index("envoy.filters.http.ext_proc") < names.index("envoy.filters.http.buffer") < names.index(ROUTER)
    assert names[-1] == ROUTER and "envoy.filters.http.cors" in names  # the mesh's own filters stay
    # The mesh's router logs each attempt to settlement (invariant 23).
    (router,) = [f for f in hcm["http_filters"] if f["name"] == ROUTER]
    assert router["typed_config"]["upstream_log"][0]["name"] == "envoy.access_loggers.http_grpc"
    routes = [r["name"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
    assert routes[0] == "healthz" and routes[-1] == "app"  # the gateway's first, the app's kept
    assert "not_found" not in routes  # no catch-all of the gateway's in someone else's listener
    assert hcm["local_reply_config"]["mappers"]  # Envoy's own replies in the contract's shape
    clusters = {c["name"] for c in boot["static_resources"]["clusters"]}
    assert {"llmgw_extproc", "pool_engine-pool", "app"} <= clusters
    pool = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "pool_engine-pool")
    assert pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "address"] == "engine-pool.llmgw.svc.cluster.local"


def test_the_cli_writes_the_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    from llmgw.cli import main

    with pytest.raises(SystemExit) as done:
        main(["envoy", "render", "--config", str(POLICY), "--target", "istio", "--namespace", "ai",
              "--selector", "istio=ingressgateway"])
    assert done.value.code == 0
    out = capsys.readouterr()
    docs = list(yaml.load_all(out.out, Loader=yaml.CSafeLoader))
    assert [d["kind"] for d in docs] == ["Service", "Service", "Service", "EnvoyFilter"]  # ext_proc, each pool
    assert docs[-1]["metadata"]["namespace"] == "ai"
    assert docs[-1]["spec"]["workloadSelector"]["labels"] == {"istio": "ingressgateway"}
    assert "&id" not in out.out and out.out == out.out.strip() + "\n"
    assert manifests_yaml(docs) in out.out
