"""The listeners in front of Envoy's admin interface: a loopback one for the operator, and one that
serves Envoy's own Prometheus metrics and nothing else of it.

Envoy's admin interface can drain listeners, change log levels and quit, and it checks no Host: a page
in a local browser whose name resolves to 127.0.0.1 could drive it. Where the renderer is given a
socket for it (`RenderOptions.admin_socket`: `llmgw up`, docker-compose), the admin interface listens
on that Unix socket only, and the admin address is a listener that forwards to it the requests that
name a loopback Host (127.0.0.1, localhost, [::1], any port) and answers every other one 403.
Where a scraper runs on another host - docker-compose's Prometheus - the stats listener forwards
exactly `GET /stats/prometheus` to the admin interface and answers 404 to every other path.
"""
from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.type.matcher.v3 import string_pb2

from extproc.names import Filter
from llmgw.render.clusters import static_cluster
from llmgw.render.common import duration_ms, http_filter, pack, socket_address

STATS_PATH = "/stats/prometheus"
ADMIN_CLUSTER = "envoy_admin"


LOOPBACK_DOMAINS = ("127.0.0.1", "localhost", "[::1]", "::1")


def _listener(name: str, listen: tuple[str, int], routes: route_pb2.RouteConfiguration,
              strip_port: bool = False) -> listener_pb2.Listener:
    hcm = hcm_pb2.HttpConnectionManager(stat_prefix=name, route_config=routes, strip_any_host_port=strip_port,
                                        http_filters=[http_filter(Filter.ROUTER, router_pb2.Router())])
    return listener_pb2.Listener(name=name, address=socket_address(*listen), filter_chains=[
        listener_components_pb2.FilterChain(filters=[listener_components_pb2.Filter(
            name=Filter.HTTP_CONNECTION_MANAGER, typed_config=pack(hcm))])])


def stats_listener(listen: tuple[str, int]) -> listener_pb2.Listener:
    get_only = [route_components_pb2.HeaderMatcher(name=":method", string_match=string_pb2.StringMatcher(exact="GET"))]
    routes = route_pb2.RouteConfiguration(name="envoy_stats", virtual_hosts=[route_components_pb2.VirtualHost(
        name="envoy_stats", domains=["*"], routes=[
            route_components_pb2.Route(match=route_components_pb2.RouteMatch(path=STATS_PATH, headers=get_only),
                                       route=route_components_pb2.RouteAction(cluster=ADMIN_CLUSTER)),
            route_components_pb2.Route(match=route_components_pb2.RouteMatch(prefix="/"),
                                       direct_response=route_components_pb2.DirectResponseAction(status=404))])])
    return _listener("envoy_stats", listen, routes)


def admin_guard(listen: tuple[str, int]) -> listener_pb2.Listener:
    """The admin address, for requests that name a loopback Host; 403 for any other Host."""
    anything = route_components_pb2.RouteMatch(prefix="/")
    refused = base_pb2.DataSource(inline_string='{"error":"the admin interface answers only requests to a '
                                                'loopback host"}')
    routes = route_pb2.RouteConfiguration(name="envoy_admin", virtual_hosts=[
        route_components_pb2.VirtualHost(name="loopback", domains=list(LOOPBACK_DOMAINS), routes=[
            route_components_pb2.Route(match=anything, route=route_components_pb2.RouteAction(
                cluster=ADMIN_CLUSTER, timeout=duration_ms(0)))]),
        route_components_pb2.VirtualHost(name="other", domains=["*"], routes=[
            route_components_pb2.Route(match=anything, direct_response=route_components_pb2.DirectResponseAction(
                status=403, body=refused))])])
    return _listener("envoy_admin", listen, routes, strip_port=True)


def admin_cluster(admin: tuple[str, int], socket_path: str | None) -> cluster_pb2.Cluster:
    """Envoy's admin interface as a cluster: on its Unix socket when it has one."""
    if socket_path is None:
        return static_cluster(ADMIN_CLUSTER, [admin], http2=False, connect_ms=1000)
    endpoint = endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
        address=pipe_address(socket_path)))
    return cluster_pb2.Cluster(name=ADMIN_CLUSTER, type=cluster_pb2.Cluster.STATIC, connect_timeout=duration_ms(1000),
                               load_assignment=endpoint_pb2.ClusterLoadAssignment(
                                   cluster_name=ADMIN_CLUSTER,
                                   endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])]))


def pipe_address(path: str) -> address_pb2.Address:
    return address_pb2.Address(pipe=address_pb2.Pipe(path=path))
