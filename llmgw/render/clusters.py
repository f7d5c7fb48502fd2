"""Upstream clusters: the engine pools (picker order, health checks, outlier ejection), deployments,
the composite clusters of fallback plans with their per-attempt filter, and the ext_proc cluster's shape."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import extension_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2 as metadata_key_pb2
from envoy.type.v3 import http_pb2 as http_types_pb2
from google.protobuf import any_pb2, wrappers_pb2

from extproc.config import Snapshot
from extproc.config.plans import (
    canary_orderings,
    candidate_subsets,
    composite_name,
    needs_attempt_filter,
    sub_clusters,
)
from extproc.config.schema import Pool
from extproc.contract import METADATA_NAMESPACE, WORKER_HEALTH_PATH
from extproc.names import LB_KEY, LB_NAMESPACE, Filter
from llmgw.render.common import UNIX, duration_ms, is_ip, pack, socket_address
from llmgw.render.composite_cluster_pb2 import ClusterConfig
from llmgw.render.filters import attempt_filter

PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _protocol_options(http2: bool) -> dict[str, any_pb2.Any]:
    opts = http_protocol_options_pb2.HttpProtocolOptions
    explicit = (opts.ExplicitHttpConfig(http2_protocol_options=protocol_pb2.Http2ProtocolOptions(
        max_concurrent_streams=wrappers_pb2.UInt32Value(value=100_000)))
                if http2 else opts.ExplicitHttpConfig(http_protocol_options=protocol_pb2.Http1ProtocolOptions()))
    return {PROTOCOL_OPTIONS: pack(opts(explicit_http_config=explicit))}


def _attempt_filters(snap: Snapshot) -> dict[str, any_pb2.Any]:
    """The upstream filter chain of a composite cluster: Envoy builds it from the routed cluster (the
    composite), whichever sub-cluster's host an attempt goes to."""
    opts = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()),
        http_filters=[hcm_pb2.HttpFilter(name=Filter.ATTEMPT, typed_config=pack(attempt_filter(snap))),
                      hcm_pb2.HttpFilter(name=Filter.UPSTREAM_CODEC,
                                         typed_config=pack(upstream_codec_pb2.UpstreamCodec()))])
    return {PROTOCOL_OPTIONS: pack(opts)}


def _composite_cluster(snap: Snapshot, name: str, sub_clusters: Iterable[str]) -> cluster_pb2.Cluster:
    """Attempt N goes to sub-cluster N (Envoy's composite cluster)."""
    config = ClusterConfig(clusters=[ClusterConfig.ClusterEntry(name=c) for c in sub_clusters])
    return cluster_pb2.Cluster(
        name=name, connect_timeout=duration_ms(1000), lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        cluster_type=cluster_pb2.Cluster.CustomClusterType(name="envoy.clusters.composite", typed_config=pack(config)),
        circuit_breakers=_thresholds(snap.gateway.envoy.max_concurrent_retries),
        typed_extension_protocol_options=_attempt_filters(snap))


def fallback_clusters(snap: Snapshot, known: set[str]) -> list[cluster_pb2.Cluster]:
    """For each route with several candidates: a composite cluster per ordered subset of them, so that
    whichever qualify for a request, its cluster holds exactly those. A route with fallback off sends
    one candidate at most: only its candidates that need the attempt filter need one (alone)."""
    composites: list[cluster_pb2.Cluster] = []
    for route in snap.routes.values():
        clusters = [snap.pool_of(snap.deployments[c.deployment_name]) if c.deployment_name in snap.deployments
                    else "" for c in route.candidates]
        credentialed = [i for i, c in enumerate(route.candidates)
                        if (d := snap.deployments.get(c.deployment_name)) is not None and needs_attempt_filter(d)]
        plans = list(candidate_subsets(len(clusters), credentialed))
        if route.canary is not None and route.fallback.enabled:
            at = next(i for i, c in enumerate(route.candidates) if c.deployment_name == route.canary.deployment)
            plans += [p for p in canary_orderings(len(clusters), at) if p not in plans]
        for subset in plans:
            if len(subset) > 1 and not route.fallback.enabled:
                continue
            if all(clusters[i] in known for i in subset):  # a candidate without a deployment never qualifies
                composites.append(_composite_cluster(snap, composite_name(route.route_contract, subset),
                                                     sub_clusters([clusters[i] for i in subset])))
    return composites


def _thresholds(max_retries: int) -> circuit_breaker_pb2.CircuitBreakers:
    """Connections and requests are bounded by the gateway's own limits (bulkheads, Envoy's
    connection cap), not here; concurrent retries are, so a dead upstream cannot trigger a storm."""
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[circuit_breaker_pb2.CircuitBreakers.Thresholds(
        max_connections=wrappers_pb2.UInt32Value(value=100_000),
        max_pending_requests=wrappers_pb2.UInt32Value(value=100_000),
        max_requests=wrappers_pb2.UInt32Value(value=100_000),
        max_retries=wrappers_pb2.UInt32Value(value=max_retries))])


def outlier_detection(consecutive: int, base_ms: int, max_percent: int) -> outlier_detection_pb2.OutlierDetection:
    """An endpoint that fails `consecutive` requests in a row at the connection level (refused,
    reset, timed out: Envoy's local-origin errors) is ejected at once, before any health check;
    error statuses an upstream sends (a 503 when overloaded) are its answers, not ejections."""
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=consecutive),
        enforcing_consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=100),
        enforcing_consecutive_5xx=wrappers_pb2.UInt32Value(value=0),
        enforcing_consecutive_gateway_failure=wrappers_pb2.UInt32Value(value=0),
        enforcing_success_rate=wrappers_pb2.UInt32Value(value=0),
        enforcing_local_origin_success_rate=wrappers_pb2.UInt32Value(value=0),
        interval=duration_ms(1000), base_ejection_time=duration_ms(base_ms),
        max_ejection_percent=wrappers_pb2.UInt32Value(value=max_percent))


def static_cluster(name: str, hosts: Iterable[tuple[str, int]], http2: bool, connect_ms: int,
                   metadata: dict[str, str] | None = None, max_retries: int = 1024) -> cluster_pb2.Cluster:
    endpoints = []
    for host, port in hosts:
        lb = endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(address=socket_address(host, port)))
        # The attempt filter reads which candidate cluster a host belongs to.
        lb.metadata.filter_metadata[METADATA_NAMESPACE].update({"cluster": name, **(metadata or {})})
        endpoints.append(lb)
    hosts = list(hosts)
    # Compose and Kubernetes address services by name; loopback deployments by IP.
    kind = (cluster_pb2.Cluster.STATIC if all(is_ip(h) or h.startswith(UNIX) for h, _ in hosts)
            else cluster_pb2.Cluster.STRICT_DNS)
    return cluster_pb2.Cluster(
        name=name, type=kind, connect_timeout=duration_ms(connect_ms),
        lb_policy=cluster_pb2.Cluster.LEAST_REQUEST,
        typed_extension_protocol_options=_protocol_options(http2),
        circuit_breakers=_thresholds(max_retries),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name, endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=endpoints)]),
    )


def _override_host_policy() -> cluster_pb2.LoadBalancingPolicy:
    """ext_proc's picker orders the engines in `envoy.lb` metadata (never a header a client could
    send); without an order (no fresh metrics) Envoy's least-request decides."""
    fallback = cluster_pb2.LoadBalancingPolicy(policies=[cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(
            name="envoy.load_balancing_policies.least_request",
            typed_config=pack(least_request_pb2.LeastRequest())))])
    policy = override_host_pb2.OverrideHost(
        override_host_sources=[override_host_pb2.OverrideHost.OverrideHostSource(
            metadata=metadata_key_pb2.MetadataKey(key=LB_NAMESPACE, path=[
                metadata_key_pb2.MetadataKey.PathSegment(key=LB_KEY)]))],
        fallback_policy=fallback)
    return cluster_pb2.LoadBalancingPolicy(policies=[cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=extension_pb2.TypedExtensionConfig(
            name="envoy.load_balancing_policies.override_host", typed_config=pack(policy)))])


def worker_health_checks(cluster: cluster_pb2.Cluster, status_ports: Sequence[int]) -> None:
    """The ext_proc cluster's active health check: each worker's status server (`GET /healthz`, on the
    port beside its gRPC one, HTTP/1.1) answers from the same event loop that decides requests, so a
    worker that is alive but cannot answer - its loop busy for seconds, stopped - misses it and leaves
    rotation within two intervals, where the outlier detection only sees refused connections."""
    for lb, port in zip(cluster.load_assignment.endpoints[0].lb_endpoints, status_ports, strict=True):
        if lb.endpoint.address.HasField("pipe"):  # a worker on a Unix socket: its status server is on loopback
            lb.endpoint.health_check_config.address.CopyFrom(socket_address("127.0.0.1", port))
        else:
            lb.endpoint.health_check_config.port_value = port
    cluster.health_checks.append(health_check_pb2.HealthCheck(
        timeout=duration_ms(1000), interval=duration_ms(1000), no_traffic_interval=duration_ms(1000),
        unhealthy_threshold=wrappers_pb2.UInt32Value(value=2),
        healthy_threshold=wrappers_pb2.UInt32Value(value=1),
        # (Host: the status server answers only a loopback one.)
        http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(
            host="127.0.0.1", path=WORKER_HEALTH_PATH, codec_client_type=http_types_pb2.HTTP1)))


def pool_cluster(name: str, pool: str, settings: Pool, hosts: Iterable[tuple[str, int]],
                  lb: str = "picker") -> cluster_pb2.Cluster:
    cluster = static_cluster(name, hosts, http2=False, connect_ms=settings.connect_timeout_ms, metadata={"pool": pool},
                             max_retries=settings.max_retries)
    o = settings.outlier
    cluster.outlier_detection.CopyFrom(outlier_detection(o.consecutive_failures, o.base_ejection_ms,
                                                          o.max_ejection_percent))
    if lb == "round_robin":
        cluster.lb_policy = cluster_pb2.Cluster.ROUND_ROBIN
    else:
        cluster.ClearField("lb_policy")
        cluster.load_balancing_policy.CopyFrom(_override_host_policy())
    cluster.health_checks.append(health_check_pb2.HealthCheck(
        # Also while a pool has no traffic (Envoy's default then is one check a minute): an engine
        # that died while idle is known before a request, or a fallback plan, needs the pool.
        timeout=duration_ms(1000), interval=duration_ms(2000), no_traffic_interval=duration_ms(2000),
        unhealthy_threshold=wrappers_pb2.UInt32Value(value=2),
        healthy_threshold=wrappers_pb2.UInt32Value(value=1),
        http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path="/health")))
    cluster.common_lb_config.healthy_panic_threshold.value = 0  # never send to hosts known to be down
    return cluster
