"""Render a config Snapshot into an Envoy bootstrap, built from Envoy's own typed protobuf messages.

Shape of the data path (docs/ARCHITECTURE.md, "The data path"):
  header_mutation  adds x-llmgw-* response headers from the metadata ext_proc returned
  ext_proc         request body BUFFERED with the headers it needs as attributes: one message per
                   request; response phases off until a stage needs them
  buffer           holds the headers until the whole body, and so ext_proc's decision, is through
  header_mutation  (request side, "llmgw.upstream_headers") drops every client header but an
                   allow-list, then sets trace context, the remaining deadline and the retry policy
                   from ext_proc's decision
  meter, stream guards, json_to_metadata
                   on the response: idempotent answers recorded for replay (ext_proc), streams
                   guarded chunk by chunk (Lua in Envoy; ext_proc for idempotent ones), usage into
                   metadata for the settlement log
  custom_response  rewrites upstream error statuses into the caller's JSON (admitted requests only)
  router           routes match on dynamic metadata only ext_proc can set, so a request that
                   ext_proc never admitted (no body, service down) can never reach an upstream

This module assembles the bootstrap; its parts live in llmgw/render/ by reason to change: filters,
routes, clusters, errors (Envoy's own answers), tls, and the small builders they share (common).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import base_pb2, protocol_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.overload.v3 import overload_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.resource_monitors.downstream_connections.v3 import downstream_connections_pb2
from google.protobuf import json_format, struct_pb2, wrappers_pb2

from extproc.config import Snapshot
from extproc.config.schema import Deployment, TlsSettings
from extproc.names import EXTPROC_CLUSTER, SHADOW_CLUSTER, Filter
from llmgw.render.clusters import (
    fallback_clusters,
    outlier_detection,
    pool_cluster,
    static_cluster,
    worker_health_checks,
)
from llmgw.render.common import UNIX, duration_ms, hp, http_filter, pack, socket_address
from llmgw.render.errors import local_reply_config, upstream_errors_filter, upstream_refusals
from llmgw.render.filters import (
    FORWARDED_HEADERS,
    attempt_log,
    ext_proc_filter,
    header_mutation_filter,
    lua_answers,
    lua_doors,
    lua_stream_guard,
    meter_filter,
    meters,
    names_outside,
    settlement_log,
    stdout_access_log,
    stream_filter,
    stream_guard_lua,
    upstream_headers_filter,
    upstream_status,
    usage_to_metadata,
)
from llmgw.render.routes import answers_translated, route_config
from llmgw.render.stats import admin_cluster, admin_guard, pipe_address, stats_listener
from llmgw.render.tls import absolute_tls, extproc_mtls, listener_tls, loopback_tls, upstream_tls

__all__ = ["FORWARDED_HEADERS", "RenderOptions", "duration_ms", "fallback_clusters",
           "names_outside", "pack", "render_bootstrap", "render_yaml", "socket_address", "static_cluster",
           "stream_guard_lua"]


COMPOSE_EXTPROC_SOCKET = "/run/llmgw/extproc.sock"  # docker-compose.yml's `decisions` volume


@dataclass(frozen=True)
class RenderOptions:
    """Where the processes of one gateway listen; defaults come from gateway.yaml's `envoy`."""

    listen: tuple[str, int]
    admin: tuple[str, int]
    extproc: tuple[tuple[str, int], ...]
    pools: dict[str, tuple[tuple[str, int], ...]]
    access_log: bool = True
    pool_lb: str = "picker"  # "picker": override_host from ext_proc's order; "round_robin": a baseline
    tls: TlsSettings = field(default_factory=TlsSettings)  # file paths as Envoy must open them
    # Per hosted deployment, where it is served instead of its `endpoints` (simulated providers).
    providers: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    # Where Envoy's /stats/prometheus (only) is served for a scraper on another host (render/stats.py).
    stats_listen: tuple[str, int] | None = None
    # Each ext_proc worker's status port, in `extproc`'s order: Envoy health-checks the workers there.
    extproc_status: tuple[int, ...] = ()
    # Where Envoy's admin interface listens instead (a Unix socket); `admin` is then a listener in
    # front of it that answers only requests naming a loopback Host (render/stats.py).
    admin_socket: str | None = None

    @classmethod
    def for_compose(cls, snap: Snapshot) -> RenderOptions:
        """docker-compose.yml's topology: services reach each other by name on its backend network (a
        hosted deployment on loopback is simulated there by the service of its name), and Envoy reaches
        ext_proc through a Unix socket on a volume only the two mount: the decision and settlement
        port is on no network at all."""
        return cls(listen=("0.0.0.0", 8080), admin=("127.0.0.1", 9901), admin_socket="/tmp/envoy-admin.sock",
                   extproc=((UNIX + COMPOSE_EXTPROC_SOCKET, 50051),),
                   pools={name: tuple((f"{name}-{i + 1}", 8000) for i in range(len(pool.endpoints)))
                          for name, pool in snap.gateway.pools.items()},
                   providers={d.deployment: ((d.deployment, 8000),) for d in simulated_providers(snap)},
                   stats_listen=("0.0.0.0", 9902))

    @classmethod
    def from_snapshot(cls, snap: Snapshot, **overrides: object) -> RenderOptions:
        env = snap.gateway.envoy
        opts: dict[str, object] = {
            "listen": hp(env.listen),
            "admin": hp(env.admin),
            "extproc": tuple(hp(e) for e in env.extproc),
            "pools": {name: tuple(hp(e) for e in pool.endpoints) for name, pool in snap.gateway.pools.items()},
            "tls": absolute_tls(snap.gateway.tls, snap.directory),
        }
        opts.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**opts)  # type: ignore[arg-type]


def _hcm(snap: Snapshot, clusters: list[str], access_log: bool) -> hcm_pb2.HttpConnectionManager:
    env = snap.gateway.envoy
    return hcm_pb2.HttpConnectionManager(
        stat_prefix="llmgw",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        always_set_request_id_in_response=True,
        stream_idle_timeout=duration_ms(300_000),
        # A slow client (headers or body trickling in, a body shorter than its Content-Length, a
        # CONNECT) cannot hold a connection: 408 once these pass, and idle connections are closed.
        request_headers_timeout=duration_ms(env.request_headers_timeout_ms),
        request_timeout=duration_ms(env.request_timeout_ms),
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(
            idle_timeout=duration_ms(env.idle_connection_timeout_ms)),
        route_config=route_config(snap, clusters),
        local_reply_config=local_reply_config(snap.revision, {
            name: r.degraded.response for name, r in snap.routes.items()
            if r.degraded is not None and r.degraded.response is not None}),
        access_log=[*([stdout_access_log()] if access_log else []), *([settlement_log()] if meters(snap) else [])],
        http_filters=[
            http_filter(Filter.HEADER_MUTATION, header_mutation_filter()),
            # Front doors (Anthropic's Messages API, Gemini's generateContent): off unless the door's
            # path turned it on. Before the decision filter, so its answers and refusals pass it last.
            http_filter(Filter.LUA_DOORS, lua_doors(), disabled=True),
            http_filter(Filter.EXT_PROC, ext_proc_filter(snap)),
            http_filter(Filter.BUFFER, buffer_pb2.Buffer(
                max_request_bytes=wrappers_pb2.UInt32Value(value=env.max_request_bytes))),
            # Only a gateway whose routes reserve budgets has anything to settle. After the buffer, so
            # the meter reads its per-route switch on the route ext_proc's decision selected. Off
            # unless the route a request matched first turns them on (chat completions): so Envoy's
            # own replies (a malformed request, a header too large) never wait for them.
            *([http_filter(Filter.METER, meter_filter(snap), disabled=True),
               http_filter(Filter.STREAMS, stream_filter(), disabled=True),
               http_filter(Filter.LUA_STREAM_GUARD, lua_stream_guard(), disabled=True),
               http_filter(Filter.JSON_TO_METADATA, usage_to_metadata())] if meters(snap) else []),
            http_filter(Filter.UPSTREAM_HEADERS, upstream_headers_filter()),
            # A lone candidate the decision translated for (extproc/direct.py): its headers after the
            # allow-list above; and its answer, or that of a plan's candidate of another shape (named
            # by the attempt filter), translated before json_to_metadata, the meter or a stream guard
            # reads it. Off unless a chat completion's first route turns it on; its script runs only
            # on the routes of those candidates and of their plans' composite clusters.
            *([http_filter(Filter.LUA_ANSWERS, lua_answers(), disabled=True)] if answers_translated(snap) else []),
            http_filter(Filter.CUSTOM_RESPONSE, upstream_errors_filter()),
            # The upstream's own status, before any filter above changes or replaces the answer; an
            # upstream's refusal with its reason in the contract's error.
            http_filter(Filter.UPSTREAM_STATUS, upstream_status(upstream_refusals())),
            http_filter(Filter.ROUTER, router_pb2.Router(upstream_log=[attempt_log()] if meters(snap) else [])),
        ],
    )


def render_bootstrap(snap: Snapshot, opts: RenderOptions) -> bootstrap_pb2.Bootstrap:
    pool_clusters = {f"pool_{name}": name for name in snap.gateway.pools}
    clusters = [static_cluster(EXTPROC_CLUSTER, opts.extproc, http2=True, connect_ms=1000)]
    # A worker that is down (restarting) leaves rotation at its first refused connection, so the
    # others take the decisions; at most half are ever ejected.
    clusters[0].outlier_detection.CopyFrom(outlier_detection(1, 1000, 50))
    if opts.extproc_status:  # ... and one alive but not answering leaves at its second missed check
        worker_health_checks(clusters[0], opts.extproc_status)
    if opts.tls.extproc is not None:
        clusters[0].transport_socket.CopyFrom(extproc_mtls(opts.tls.extproc))
    for cluster_name, pool in pool_clusters.items():
        hosts = opts.pools.get(pool) or tuple(hp(e) for e in snap.gateway.pools[pool].endpoints)
        clusters.append(pool_cluster(cluster_name, pool, snap.gateway.pools[pool], hosts, opts.pool_lb))
    for dep in snap.deployments.values():
        if dep.endpoints:
            hosts = opts.providers.get(dep.deployment) or tuple(hp(e) for e in dep.endpoints)
            clusters.append(static_cluster(snap.pool_of(dep), hosts,
                                           http2=False, connect_ms=1000,
                                           max_retries=snap.gateway.envoy.max_concurrent_retries))
            if dep.tls is not None:
                ca = Path(dep.tls.ca_file)
                clusters[-1].transport_socket.CopyFrom(upstream_tls(
                    dep.server_name, str(ca if ca.is_absolute() else snap.directory / ca)))
    upstream = [c.name for c in clusters[1:]]
    fallbacks = fallback_clusters(snap, set(upstream))
    clusters += fallbacks
    if any(r.shadow is not None for r in snap.routes.values()):
        # Shadow copies come back in through the gateway's own listener (extproc/shadow.py).
        host, port = opts.listen
        clusters.append(static_cluster(SHADOW_CLUSTER, [("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)],
                                       http2=False, connect_ms=1000))
        if opts.tls.listener is not None:
            clusters[-1].transport_socket.CopyFrom(loopback_tls())
    hcm = _hcm(snap, upstream + [c.name for c in fallbacks], opts.access_log)
    listener = listener_pb2.Listener(
        name="llmgw", address=socket_address(*opts.listen),
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(value=snap.gateway.envoy.max_request_bytes),
        filter_chains=[listener_components_pb2.FilterChain(filters=[listener_components_pb2.Filter(
            name=Filter.HTTP_CONNECTION_MANAGER, typed_config=pack(hcm))])])
    if opts.tls.listener is not None:
        listener.filter_chains[0].transport_socket.CopyFrom(listener_tls(opts.tls.listener))
    listeners = [listener]
    if opts.stats_listen is not None:
        listeners.append(stats_listener(opts.stats_listen))
    if opts.admin_socket is not None:  # the admin interface on its socket, behind a loopback-only listener
        listeners.append(admin_guard(opts.admin))
    if opts.stats_listen is not None or opts.admin_socket is not None:
        clusters.append(admin_cluster(opts.admin, opts.admin_socket))
    # A bounded number of client connections: each can make ext_proc buffer a body before its verdict.
    overload = overload_pb2.OverloadManager(resource_monitors=[overload_pb2.ResourceMonitor(
        name="envoy.resource_monitors.global_downstream_max_connections",
        typed_config=pack(downstream_connections_pb2.DownstreamConnectionsConfig(
            max_active_downstream_connections=snap.gateway.envoy.max_connections)))])
    # The header allow-list's pattern (names_outside) is larger than RE2 programs Envoy accepts by
    # default (100); it is fixed at render time, never a client's.
    runtime = struct_pb2.Struct()
    runtime.update({"re2.max_program_size.error_level": 1000, "re2.max_program_size.warn_level": 1000})
    return bootstrap_pb2.Bootstrap(
        node=base_pb2.Node(id="llmgw", cluster="llmgw"),
        layered_runtime=bootstrap_pb2.LayeredRuntime(layers=[
            bootstrap_pb2.RuntimeLayer(name="static", static_layer=runtime),
            bootstrap_pb2.RuntimeLayer(name="admin", admin_layer=bootstrap_pb2.RuntimeLayer.AdminLayer())]),
        overload_manager=overload,
        admin=bootstrap_pb2.Admin(address=pipe_address(opts.admin_socket) if opts.admin_socket is not None
                                  else socket_address(*opts.admin)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(listeners=listeners, clusters=clusters),
    )


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def simulated_providers(snap: Snapshot) -> list[Deployment]:
    """Hosted deployments served on this machine (every endpoint on loopback): `llmgw up` and
    docker-compose run a simulated provider of the deployment's API shape for each."""
    return [d for d in snap.deployments.values()
            if d.endpoints and all(hp(e)[0] in LOOPBACK for e in d.endpoints)]


def render_yaml(snap: Snapshot, opts: RenderOptions) -> str:
    # Through JSON so that Any payloads become plain dicts YAML can write; sorted so renders are stable.
    doc = json.loads(json_format.MessageToJson(render_bootstrap(snap, opts), preserving_proto_field_name=True,
                                               sort_keys=True))  # map order is not stable otherwise
    header = f"# Rendered by `llmgw envoy render` from policy revision {snap.revision}. Do not edit.\n"
    # libyaml's emitter: the bootstrap is megabytes of YAML, which the pure-Python one takes seconds over.
    return header + yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False, width=120)
