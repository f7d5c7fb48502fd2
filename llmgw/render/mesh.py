"""Manifests for mesh operators: the gateway's Envoy pieces for an Envoy that Istio or Envoy Gateway
manages, rendered from the same messages as the standalone bootstrap (llmgw/render/bootstrap.py).

What the gateway needs of Envoy cannot be said in either's high-level API: one ext_proc message per
request (request headers SKIP, a buffer filter holding the headers until the decision), routes matched on
the decision's dynamic metadata, composite clusters with a per-attempt ext_proc upstream filter, the Lua
stream guard. Envoy Gateway's EnvoyExtensionPolicy has no header SKIP mode and no way to route on
metadata. So each target carries the pieces as xDS patches, which both offer for what their APIs do
not: Istio an EnvoyFilter (typed patches by context), Envoy Gateway an EnvoyPatchPolicy (RFC 6902
JSON patches on its generated listener, route configuration and clusters, which must be enabled in
its EnvoyGateway configuration: `extensionApis.enableEnvoyPatchPolicy`). Beside them: a Service for
the ext_proc workers and a headless Service per engine pool (Envoy resolves every engine behind it, so
the picker can name one).

The gateway's own catch-all (404 for everything else) is left out: in a mesh the listener serves
other routes too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from extproc.config import Snapshot
from extproc.names import Filter

HCM = str(Filter.HTTP_CONNECTION_MANAGER)  # plain text: the manifests are YAML
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = str(Filter.ROUTER)
EXTPROC_PORT, ENGINE_PORT = 50051, 8000
# HCM settings the gateway needs beside its filters and routes (timeouts against slow clients, its
# contract errors for Envoy's own replies, its access logs, request ids in answers).
HCM_SETTINGS = ("request_headers_timeout", "request_timeout", "common_http_protocol_options", "local_reply_config",
                "access_log", "always_set_request_id_in_response")
VHOST_SETTINGS = ("include_attempt_count_in_response", "include_request_attempt_count")
# Router settings the gateway needs on the mesh's router: the attempt log settlement charges every
# attempt from (invariant 23).
ROUTER_SETTINGS = ("upstream_log",)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def as_dict(msg: Message) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json_format.MessageToJson(msg, preserving_proto_field_name=True,
                                                               sort_keys=True))
    return doc


@dataclass(frozen=True)
class MeshTarget:
    namespace: str = "llmgw"
    listen_port: int = 8080  # the gateway listener's (container) port: patches match it; copies loop to it
    # Istio: which proxies (workload labels) and which of their listeners (context).
    selector: dict[str, str] = field(default_factory=lambda: {"app": "llmgw-gateway"})
    context: str = "GATEWAY"  # or SIDECAR_INBOUND
    # Envoy Gateway: the Gateway and listener the patches name (`<namespace>/<gateway>/<listener>`).
    gateway: str = "llmgw"
    listener: str = "http"

    def service(self, name: str) -> str:
        return f"{name}.{self.namespace}.svc.cluster.local"


@dataclass(frozen=True)
class Pieces:
    filters: list[dict[str, Any]]  # the HTTP filters, in order, the router left out
    hcm: dict[str, Any]  # HCM_SETTINGS
    vhost: dict[str, Any]  # VHOST_SETTINGS
    routes: list[dict[str, Any]]  # in order, the catch-all left out
    clusters: list[dict[str, Any]]
    runtime: dict[str, Any]  # the bootstrap's static runtime layer
    router: dict[str, Any]  # what the gateway sets on the mesh's own router (its attempt log)


def pieces(snap: Snapshot, target: MeshTarget) -> Pieces:
    from llmgw.render.bootstrap import RenderOptions, render_bootstrap

    opts = RenderOptions(
        listen=("0.0.0.0", target.listen_port), admin=("127.0.0.1", 9901),
        extproc=((target.service("llmgw-extproc"), EXTPROC_PORT),),
        pools={name: ((target.service(name), ENGINE_PORT),) for name in snap.gateway.pools}, access_log=True)
    boot = as_dict(render_bootstrap(snap, opts))
    (listener,) = [x for x in boot["static_resources"]["listeners"] if x["name"] == "llmgw"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    router = next(f for f in hcm["http_filters"] if f["name"] == ROUTER)
    return Pieces(
        filters=[f for f in hcm["http_filters"] if f["name"] != ROUTER],
        hcm={k: hcm[k] for k in HCM_SETTINGS if k in hcm},
        vhost={k: vhost[k] for k in VHOST_SETTINGS if k in vhost},
        routes=[r for r in vhost["routes"] if r.get("name") != "not_found"],
        clusters=boot["static_resources"]["clusters"],
        runtime=next(layer["static_layer"] for layer in boot["layered_runtime"]["layers"] if "static_layer" in layer),
        router={k: v for k, v in router["typed_config"].items() if k in ROUTER_SETTINGS})


def runtime_layer(runtime: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap's runtime as one more layer of the mesh's (RE2 program size for the allow-list)."""
    return {"layered_runtime": {"layers": [{"name": "llmgw", "static_layer": runtime}]}}


def services(snap: Snapshot, target: MeshTarget) -> list[dict[str, Any]]:
    def service(name: str, port: int, headless: bool, app_protocol: str) -> dict[str, Any]:
        spec: dict[str, Any] = {"selector": {"app.kubernetes.io/name": name},
                                "ports": [{"name": app_protocol, "port": port, "targetPort": port,
                                           "appProtocol": app_protocol}]}
        if headless:
            spec["clusterIP"] = "None"
        return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": target.namespace,
                "labels": {"app.kubernetes.io/part-of": "llmgw"}}, "spec": spec}
    return [service("llmgw-extproc", EXTPROC_PORT, False, "grpc"),
            *(service(pool, ENGINE_PORT, True, "http") for pool in sorted(snap.gateway.pools))]


def istio(snap: Snapshot, target: MeshTarget) -> list[dict[str, Any]]:
    p = pieces(snap, target)
    ctx = target.context
    on_listener = {"context": ctx, "listener": {"portNumber": target.listen_port,
                                                "filterChain": {"filter": {"name": HCM}}}}
    before_router = {"context": ctx, "listener": {"portNumber": target.listen_port, "filterChain": {
        "filter": {"name": HCM, "subFilter": {"name": ROUTER}}}}}
    on_routes = {"context": ctx, "routeConfiguration": {"portNumber": target.listen_port}}
    patches: list[dict[str, Any]] = [
        # In order: each lands just before the router, after the ones before it.
        *({"applyTo": "HTTP_FILTER", "match": before_router, "patch": {"operation": "INSERT_BEFORE", "value": f}}
          for f in p.filters),
        {"applyTo": "NETWORK_FILTER", "match": on_listener,
         "patch": {"operation": "MERGE", "value": {"name": HCM, "typed_config": {"@type": HCM_TYPE, **p.hcm}}}},
        {"applyTo": "VIRTUAL_HOST", "match": on_routes, "patch": {"operation": "MERGE", "value": p.vhost}},
        *([{"applyTo": "HTTP_FILTER", "match": before_router, "patch": {"operation": "MERGE", "value": {
            "name": ROUTER, "typed_config": {"@type": ROUTER_TYPE, **p.router}}}}] if p.router else []),
        # INSERT_FIRST in reverse: the gateway's routes end up first, in their order.
        *({"applyTo": "HTTP_ROUTE", "match": on_routes, "patch": {"operation": "INSERT_FIRST", "value": r}}
          for r in reversed(p.routes)),
        *({"applyTo": "CLUSTER", "match": {"context": ctx}, "patch": {"operation": "ADD", "value": c}}
          for c in p.clusters),
        {"applyTo": "BOOTSTRAP", "patch": {"operation": "MERGE", "value": runtime_layer(p.runtime)}},
    ]
    envoy_filter = {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
                    "metadata": {"name": "llmgw", "namespace": target.namespace},
                    "spec": {"workloadSelector": {"labels": dict(target.selector)}, "configPatches": patches}}
    return [*services(snap, target), envoy_filter]


def envoy_gateway(snap: Snapshot, target: MeshTarget) -> list[dict[str, Any]]:
    p = pieces(snap, target)
    name = f"{target.namespace}/{target.gateway}/{target.listener}"
    listener_t, routes_t = ("type.googleapis.com/envoy.config.listener.v3.Listener",
                            "type.googleapis.com/envoy.config.route.v3.RouteConfiguration")
    hcm_path = "/default_filter_chain/filters/0/typed_config"
    router_at = f"$.default_filter_chain.filters[0].typed_config.http_filters[?(@.name=='{ROUTER}')].typed_config"

    def op(kind: str, resource: str, path: str, value: Any) -> dict[str, Any]:
        return {"type": kind, "name": resource, "operation": {"op": "add", "path": path, "value": value}}
    patches = [
        # Inserted at 0, 1, ...: the gateway's filters first, in their order, before Envoy Gateway's.
        *(op(listener_t, name, f"{hcm_path}/http_filters/{i}", f) for i, f in enumerate(p.filters)),
        *(op(listener_t, name, f"{hcm_path}/{k}", v) for k, v in p.hcm.items()),
        *(op(routes_t, name, f"/virtual_hosts/0/{k}", v) for k, v in p.vhost.items()),
        # The router is Envoy Gateway's, last in its chain at an index the policy cannot know: found by name.
        *({"type": listener_t, "name": name, "operation": {"op": "add", "jsonPath": router_at, "path": f"/{k}",
                                                             "value": v}} for k, v in p.router.items()),
        *(op(routes_t, name, f"/virtual_hosts/0/routes/{i}", r) for i, r in enumerate(p.routes)),
        *(op("type.googleapis.com/envoy.config.cluster.v3.Cluster", c["name"], "", c) for c in p.clusters),
    ]
    # A patch policy cannot reach the bootstrap: the runtime the header allow-list's RE2 program needs
    # goes into the EnvoyProxy the Gateway's class names (`infrastructure.parametersRef`).
    proxy = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyProxy",
             "metadata": {"name": "llmgw", "namespace": target.namespace},
             "spec": {"bootstrap": {"type": "Merge", "value": yaml.safe_dump(runtime_layer(p.runtime))}}}
    policy = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyPatchPolicy",
              "metadata": {"name": "llmgw", "namespace": target.namespace},
              "spec": {"targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": target.gateway},
                       "type": "JSONPatch", "jsonPatches": patches}}
    return [*services(snap, target), proxy, policy]


TARGETS = {"istio": istio, "envoy-gateway": envoy_gateway}


class _NoAliases(yaml.CSafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # every match written out: kubectl users read them
        return True


def manifests_yaml(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, width=120)


def render_manifests(snap: Snapshot, kind: str, target: MeshTarget) -> list[dict[str, Any]]:
    return TARGETS[kind](snap, target)
