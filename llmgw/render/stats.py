"""A listener that serves Envoy's own Prometheus metrics, and nothing else of its admin interface.

Envoy's admin interface stays on loopback (it can drain listeners, change log levels and quit). Where
a scraper runs on another host - docker-compose's Prometheus - this listener forwards exactly
`GET /stats/prometheus` to the admin address and answers 404 to every other path, so the scraper
reads Envoy's metrics beside the gateway's without reaching the admin interface.
"""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from llmgw.render.clusters import static_cluster
from llmgw.render.common import http_filter, pack, socket_address

STATS_PATH = "/stats/prometheus"
ADMIN_CLUSTER = "envoy_admin"


def stats_listener(listen: tuple[str, int], admin: tuple[str, int]) -> tuple[listener_pb2.Listener,
                                                                               cluster_pb2.Cluster]:
    get_only = [route_components_pb2.HeaderMatcher(name=":method", exact_match="GET")]
    routes = route_pb2.RouteConfiguration(name="envoy_stats", virtual_hosts=[route_components_pb2.VirtualHost(
        name="envoy_stats", domains=["*"], routes=[
            route_components_pb2.Route(match=route_components_pb2.RouteMatch(path=STATS_PATH, headers=get_only),
                                       route=route_components_pb2.RouteAction(cluster=ADMIN_CLUSTER)),
            route_components_pb2.Route(match=route_components_pb2.RouteMatch(prefix="/"),
                                       direct_response=route_components_pb2.DirectResponseAction(status=404))])])
    hcm = hcm_pb2.HttpConnectionManager(stat_prefix="envoy_stats", route_config=routes,
                                        http_filters=[http_filter("envoy.filters.http.router", router_pb2.Router())])
    listener = listener_pb2.Listener(name="envoy_stats", address=socket_address(*listen), filter_chains=[
        listener_components_pb2.FilterChain(filters=[listener_components_pb2.Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm))])])
    return listener, static_cluster(ADMIN_CLUSTER, [admin], http2=False, connect_ms=1000)
