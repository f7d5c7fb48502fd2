"""Small builders the renderer's modules share: Any packing, durations, addresses, filters."""

from __future__ import annotations

import ipaddress

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import address_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.type.matcher.v3 import string_pb2, value_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message


def pack(msg: Message) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def duration_ms(ms: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(ms)
    return d


UNIX = "unix:"  # a host of this form is a Unix socket's path (the port then only names it)


def socket_address(host: str, port: int) -> address_pb2.Address:
    if host.startswith(UNIX):
        return address_pb2.Address(pipe=address_pb2.Pipe(path=host.removeprefix(UNIX)))
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port))


def hp(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def http_filter(name: str, msg: object, disabled: bool = False) -> hcm_pb2.HttpFilter:
    return hcm_pb2.HttpFilter(name=name, typed_config=pack(msg), disabled=disabled)


def string_value_matcher(s: str) -> value_pb2.ValueMatcher:
    return value_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(exact=s))


def cel_filter(expr: str) -> accesslog_pb2.AccessLogFilter:
    """An access-log (or local-reply mapper) filter on a CEL expression."""
    return accesslog_pb2.AccessLogFilter(extension_filter=accesslog_pb2.ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=pack(cel_pb2.ExpressionFilter(expression=expr))))
