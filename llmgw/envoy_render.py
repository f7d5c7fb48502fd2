"""Render a config Snapshot into an Envoy bootstrap, built from Envoy's own typed protobuf messages.

Shape of the data path (design.md section 7, reference/envoy-notes.md):
  header_mutation  adds x-llmgw-* response headers from the metadata ext_proc returned
  ext_proc         request body BUFFERED with the headers it needs as attributes: one message per
                   request; response phases off until a stage needs them
  buffer           holds the headers until the whole body, and so ext_proc's decision, is through
  header_mutation  (request side, "llmgw.upstream_headers") drops every client header but an
                   allow-list, then sets trace context, the remaining deadline and the retry policy
                   from ext_proc's decision
  custom_response  rewrites upstream error statuses into the contract's JSON
  router           routes match on dynamic metadata only ext_proc can set, so a request that
                   ext_proc never admitted (no body, service down) can never reach an upstream
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.overload.v3 import overload_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.custom_response.v3 import custom_response_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.http.upstream_codec.v3 import upstream_codec_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.http.custom_response.local_response_policy.v3 import local_response_policy_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.resource_monitors.downstream_connections.v3 import downstream_connections_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, status_code_input_pb2, string_pb2, value_pb2
from envoy.type.metadata.v3 import metadata_pb2 as metadata_key_pb2
from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    json_format,
    message_factory,
    struct_pb2,
    wrappers_pb2,
)
from google.protobuf.message import Message
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2

from extproc.attempts import ATTEMPT_ATTRIBUTES, ATTEMPT_WITHOUT_BODY
from extproc.config import Snapshot
from extproc.config.schema import ExtprocTls, ListenerTls, Pool, TlsSettings
from extproc.contract import CHAT_PATH, METADATA_NAMESPACE, MODELS_PATH, REVISION_HEADER, ROLE_KEY, ErrorCode, Role
from extproc.fallback import candidate_subsets, composite_name, sub_clusters
from extproc.names import INTERRUPTED, Key, Settle
from extproc.picker import LB_KEY, LB_NAMESPACE
from extproc.settlement import ANSWERED_BY, METER_ATTRIBUTES
from extproc.sse import MAX_EVENT_BYTES
from extproc.streams import interrupted_event

EXTPROC_CLUSTER = "llmgw_extproc"
OWN_REPLY_PREFIX = "llmgw"  # details of ext_proc's own ImmediateResponses start with this


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

    @classmethod
    def for_compose(cls, snap: Snapshot) -> RenderOptions:
        """docker-compose.yml's topology: services reach each other by name on one network."""
        return cls(listen=("0.0.0.0", 8080), admin=("127.0.0.1", 9901), extproc=(("extproc", 50051),),
                   pools={name: tuple((f"{name}-{i + 1}", 8000) for i in range(len(pool.endpoints)))
                          for name, pool in snap.gateway.pools.items()})

    @classmethod
    def from_snapshot(cls, snap: Snapshot, **overrides: object) -> RenderOptions:
        env = snap.gateway.envoy
        opts: dict[str, object] = {
            "listen": _hp(env.listen),
            "admin": _hp(env.admin),
            "extproc": tuple(_hp(e) for e in env.extproc),
            "pools": {name: tuple(_hp(e) for e in pool.endpoints) for name, pool in snap.gateway.pools.items()},
            "tls": absolute_tls(snap.gateway.tls, snap.directory),
        }
        opts.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**opts)  # type: ignore[arg-type]


def absolute_tls(tls: TlsSettings, base: Path) -> TlsSettings:
    """gateway.yaml's certificate paths are relative to the policy directory; Envoy needs them whole."""
    def fix(model: ListenerTls | ExtprocTls | None) -> dict[str, object] | None:
        if model is None:
            return None
        return {k: (str(base / v) if k.endswith("_file") and isinstance(v, str) else v)
                for k, v in model.model_dump().items()}
    return TlsSettings.model_validate({"listener": fix(tls.listener), "extproc": fix(tls.extproc)})


def _file(path: str) -> base_pb2.DataSource:
    return base_pb2.DataSource(filename=path)  # Envoy reads the file; the config never holds a key


def _listener_tls(tls: ListenerTls) -> base_pb2.TransportSocket:
    common = tls_pb2.CommonTlsContext(
        tls_certificates=[tls_common_pb2.TlsCertificate(certificate_chain=_file(tls.cert_file),
                                                        private_key=_file(tls.key_file))],
        alpn_protocols=["h2", "http/1.1"])
    if tls.client_ca_file:
        common.validation_context.trusted_ca.CopyFrom(_file(tls.client_ca_file))
    ctx = tls_pb2.DownstreamTlsContext(
        common_tls_context=common,
        require_client_certificate=wrappers_pb2.BoolValue(value=tls.require_client_certificate))
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))


def _extproc_mtls(tls: ExtprocTls) -> base_pb2.TransportSocket:
    """Envoy -> ext_proc: verify ext_proc's certificate against the CA and present Envoy's own."""
    common = tls_pb2.CommonTlsContext(
        tls_certificates=[tls_common_pb2.TlsCertificate(certificate_chain=_file(tls.client_cert_file),
                                                        private_key=_file(tls.client_key_file))],
        validation_context=tls_common_pb2.CertificateValidationContext(
            trusted_ca=_file(tls.ca_file),
            match_typed_subject_alt_names=[tls_common_pb2.SubjectAltNameMatcher(
                san_type=tls_common_pb2.SubjectAltNameMatcher.DNS,
                matcher=string_pb2.StringMatcher(exact=tls.server_name))]),
        alpn_protocols=["h2"])
    ctx = tls_pb2.UpstreamTlsContext(common_tls_context=common, sni=tls.server_name)
    return base_pb2.TransportSocket(name="envoy.transport_sockets.tls", typed_config=pack(ctx))


def _hp(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def pack(msg: Message) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def duration_ms(ms: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(ms)
    return d


def socket_address(host: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port))


def _contract_json(code: ErrorCode, message: str, status_fmt: str | None = None) -> (
        substitution_format_string_pb2.SubstitutionFormatString):
    """The contract's error body as an Envoy JSON format string."""
    error = struct_pb2.Struct()
    error.update({"message": message, "type": code.error_type, "code": code.value})
    error.fields["param"].null_value = struct_pb2.NULL_VALUE
    body = struct_pb2.Struct()
    body.fields["error"].struct_value.CopyFrom(error)
    return substitution_format_string_pb2.SubstitutionFormatString(
        json_format=body, content_type="application/json")


def _cel_filter(expr: str) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(extension_filter=accesslog_pb2.ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=pack(cel_pb2.ExpressionFilter(expression=expr))))


# Envoy's own local replies -> contract errors. ext_proc's ImmediateResponses (details `llmgw*`) and
# direct responses (already contract JSON) pass untouched.
# custom_response's replies carry empty details.
_NOT_OURS = (f"!response.code_details.startsWith('{OWN_REPLY_PREFIX}') && "
             "response.code_details != 'direct_response' && response.code_details != ''")
LOCAL_REPLY_RULES: tuple[tuple[str, int, ErrorCode, str], ...] = (
    ("response.code_details.startsWith('ext_proc')", 503, ErrorCode.POLICY_UNAVAILABLE,
     "the gateway's policy service is unavailable; the request was not processed"),
    (f"{_NOT_OURS} && response.code == 413", 413, ErrorCode.INVALID_REQUEST,
     "request body exceeds the gateway's size limit"),
    (f"{_NOT_OURS} && response.code == 408", 408, ErrorCode.INVALID_REQUEST,
     "the request did not arrive within the gateway's time limit"),
    (f"{_NOT_OURS} && response.code == 504", 504, ErrorCode.DEADLINE_EXCEEDED,
     "the upstream did not answer within the deadline"),
    (f"{_NOT_OURS} && response.code == 404", 404, ErrorCode.ROUTE_NOT_FOUND, "no such endpoint"),
    (f"{_NOT_OURS} && response.code >= 500", 502, ErrorCode.UPSTREAM_ERROR,
     "every eligible upstream attempt failed before the first byte"),
    (f"{_NOT_OURS} && response.code >= 400", 400, ErrorCode.INVALID_REQUEST,
     "the request could not be processed"),
)


def _local_reply_config(revision: str) -> hcm_pb2.LocalReplyConfig:
    """Envoy's own replies in the contract's shape, naming the revision Envoy was rendered from. The
    response filters that could hold such a reply are off unless a chat route turned them on, so a
    reply to a request Envoy could not even parse is complete (a filter waiting for ext_proc once
    left it without its body when Envoy closed the connection)."""
    revision_header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=REVISION_HEADER, value=revision),
                                                 append_action=base_pb2.HeaderValueOption.ADD_IF_ABSENT)
    return hcm_pb2.LocalReplyConfig(mappers=[
        hcm_pb2.ResponseMapper(
            filter=_cel_filter(expr),
            status_code=wrappers_pb2.UInt32Value(value=status),
            body_format_override=_contract_json(code, message),
            headers_to_add=[revision_header],
        )
        for expr, status, code, message in LOCAL_REPLY_RULES
    ])


# Upstream error statuses -> contract errors (the upstream's own body shape is not the contract's).
UPSTREAM_ERROR_RULES: tuple[tuple[int, int, ErrorCode, str], ...] = (
    (400, 400, ErrorCode.INVALID_REQUEST, "the upstream rejected the request as invalid"),
    (408, 504, ErrorCode.DEADLINE_EXCEEDED, "the upstream timed out"),
    (413, 413, ErrorCode.INVALID_REQUEST, "the upstream rejected the request as too large"),
    (422, 400, ErrorCode.INVALID_REQUEST, "the upstream rejected the request as invalid"),
    (429, 502, ErrorCode.UPSTREAM_ERROR, "the upstream is overloaded (429)"),
    (500, 502, ErrorCode.UPSTREAM_ERROR, "the upstream failed (500)"),
    (502, 502, ErrorCode.UPSTREAM_ERROR, "the upstream failed (502)"),
    (503, 502, ErrorCode.UPSTREAM_ERROR, "the upstream is unavailable (503)"),
    (504, 504, ErrorCode.DEADLINE_EXCEEDED, "the upstream timed out (504)"),
    (529, 502, ErrorCode.UPSTREAM_ERROR, "the upstream is overloaded (529)"),
)


def _custom_response_filter() -> custom_response_pb2.CustomResponse:
    status_input = xds_extension_pb2.TypedExtensionConfig(
        name="status", typed_config=pack(status_code_input_pb2.HttpResponseStatusCodeMatchInput()))
    tree = matcher_pb2.Matcher.MatcherTree(
        input=status_input,
        exact_match_map=matcher_pb2.Matcher.MatcherTree.MatchMap(map={
            str(upstream): matcher_pb2.Matcher.OnMatch(action=xds_extension_pb2.TypedExtensionConfig(
                name=f"upstream_{upstream}",
                typed_config=pack(local_response_policy_pb2.LocalResponsePolicy(
                    status_code=wrappers_pb2.UInt32Value(value=status),
                    body_format=_contract_json(code, message),
                    # Its content_type is ignored in 1.40; the header is set here instead.
                    response_headers_to_add=[*_upstream_answer_headers(), base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)],
                ))))
            for upstream, status, code, message in UPSTREAM_ERROR_RULES
        }))
    return custom_response_pb2.CustomResponse(custom_response_matcher=matcher_pb2.Matcher(matcher_tree=tree))


def _admitted_route_filters() -> dict[str, any_pb2.Any]:
    """Upstream errors are rewritten only on admitted routes, so ext_proc's own replies stay as sent."""
    return {"envoy.filters.http.custom_response": pack(_custom_response_filter())}


# The contract's response headers, from the metadata ext_proc returned with its decision.
ANSWER_HEADERS: tuple[tuple[str, str], ...] = (
    (REVISION_HEADER, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:revision)%"),
    ("x-llmgw-deployment", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:deployment)%"),
    ("x-llmgw-attempts", "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
)


def _upstream_answer_headers() -> list[base_pb2.HeaderValueOption]:
    """x-llmgw-deployment only where absent: on a fallback route the attempt filter named the candidate
    that answered; every other admitted route removes whatever an upstream sent under that name."""
    hvo = base_pb2.HeaderValueOption
    return [hvo(header=base_pb2.HeaderValue(key=k, value=v),
                append_action=hvo.ADD_IF_ABSENT if k == ANSWERED_BY else hvo.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in ANSWER_HEADERS]


UPSTREAM_HEADERS_FILTER = "llmgw.upstream_headers"
# What a client sent reaches an upstream only by these names; the rest (cookies, API keys meant for
# the gateway, client-chosen x-llmgw-* and test headers, junk) stays here. An attempt's credential is
# added per candidate by the attempt filter, after this. x-forwarded-proto is Envoy's own (it overwrites
# a client's, use_remote_address), and its route matching needs it when a filter cleared the route.
FORWARDED_HEADERS = ("content-type", "content-length", "x-request-id", "x-forwarded-proto")
# Set from ext_proc's decision (its metadata), after the allow-list: trace context only when valid
# and the route propagates it; the remaining deadline and this request's retry policy for the router
# (ext_proc's body reply cannot set request headers when headers were skipped). Empty values - no
# metadata - add no header.
DECISION_HEADERS: tuple[tuple[str, str], ...] = (
    ("traceparent", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:traceparent)%"),
    ("tracestate", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:tracestate)%"),
    ("x-envoy-upstream-rq-timeout-ms", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:rq_timeout_ms)%"),
    ("x-envoy-upstream-rq-per-try-timeout-ms", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:per_try_timeout_ms)%"),
    # The retry policy ext_proc chose for this request (extproc/stages/retry.py); Envoy's router is
    # the one retry owner, and the route itself allows none.
    ("x-envoy-retry-on", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:retry_on)%"),
    ("x-envoy-retriable-status-codes", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:retriable_codes)%"),
    ("x-envoy-max-retries", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:max_retries)%"),
)


def names_outside(allowed: Iterable[str]) -> str:
    """An RE2 pattern (RE2 has no negative lookahead) matching every header name except `allowed` and
    the pseudo-headers (`:path`, ...): built from the names' trie, each node matching any suffix that
    leaves it."""
    end = ""
    trie: dict[str, Any] = {}
    for name in allowed:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[end] = {}

    def suffixes(node: dict[str, Any], root: bool) -> str:
        chars = sorted(c for c in node if c != end)
        other = "".join(re.escape(c) for c in chars) + (":" if root else "")
        parts = [f"[^{other}].*" if other else ".+"]
        parts += [f"{re.escape(c)}(?:{suffixes(node[c], False)})" for c in chars]
        alternatives = "|".join(parts)
        return alternatives if end in node else f"(?:{alternatives})?"
    return f"^(?:{suffixes(trie, True)})$"


def _upstream_headers_filter() -> header_mutation_pb2.HeaderMutation:
    hvo = base_pb2.HeaderValueOption
    strip = mutation_rules_pb2.HeaderMutation(remove_on_match=mutation_rules_pb2.HeaderMutation.RemoveOnMatch(
        key_matcher=string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(
            regex=names_outside(FORWARDED_HEADERS)))))
    return header_mutation_pb2.HeaderMutation(mutations=header_mutation_pb2.Mutations(request_mutations=[
        strip, *(mutation_rules_pb2.HeaderMutation(append=hvo(
            header=base_pb2.HeaderValue(key=k, value=v), append_action=hvo.OVERWRITE_IF_EXISTS_OR_ADD))
            for k, v in DECISION_HEADERS)]))


def _header_mutation_filter() -> header_mutation_pb2.HeaderMutation:
    return header_mutation_pb2.HeaderMutation(mutations=header_mutation_pb2.Mutations(response_mutations=[
        mutation_rules_pb2.HeaderMutation(append=h) for h in _upstream_answer_headers()]))


# Headers ext_proc reads as CEL attributes on the body message (the whole map is not serializable).
REQUEST_ATTRIBUTES = (
    "request.id", "request.path", "request.method", "request.time",
    "request.headers['authorization']", "request.headers['x-llmgw-data-class']",
    "request.headers['idempotency-key']", "request.headers['x-llmgw-deadline-ms']",
    "request.headers['traceparent']", "request.headers['tracestate']",
)


def _extproc_service(role: Role | None = None) -> grpc_service_pb2.GrpcService:
    """The ext_proc cluster, for every filter and the access log that talk to it; `role` (gRPC
    metadata) tells ext_proc which kind of stream starts (extproc/server.py dispatches on it)."""
    service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EXTPROC_CLUSTER))
    if role is not None:
        service.initial_metadata.append(base_pb2.HeaderValue(key=ROLE_KEY, value=role.value))
    return service


def _ext_proc_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(),
        failure_mode_allow=False,
        # One message per request: the buffered body, with the headers ext_proc needs as attributes.
        # Header mode SKIP lets the headers pass ext_proc at once; the buffer filter after it holds them
        # until the body (and so ext_proc's decision) is through, so the router never routes early.
        processing_mode=pm(request_header_mode=pm.SKIP, request_body_mode=pm.BUFFERED,
                           response_header_mode=pm.SKIP, response_body_mode=pm.NONE),
        request_attributes=list(REQUEST_ATTRIBUTES),
        message_timeout=duration_ms(snap.gateway.envoy.extproc_message_timeout_ms),
        mutation_rules=mutation_rules_pb2.HeaderMutationRules(allow_envoy=wrappers_pb2.BoolValue(value=True)),
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[METADATA_NAMESPACE, "envoy.lb"])),
    )


METER_FILTER = "llmgw.meter"


def _meter_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    """Idempotent JSON answers (their own admitted route): each body chunk waits for ext_proc, which
    holds the last until the answer is recorded for replay and settled, so a repeat of the key that
    follows the answer is replayed (extproc/settlement.py). If ext_proc fails, the answer continues
    (the access log's backstop and the lease settle it)."""
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(Role.METER),
        failure_mode_allow=True,
        message_timeout=duration_ms(snap.gateway.envoy.extproc_message_timeout_ms),
        # Headers SKIP: status and content type come as attributes with the first body chunk, so a JSON
        # answer costs one message.
        processing_mode=pm(request_header_mode=pm.SKIP, request_body_mode=pm.NONE,
                           response_header_mode=pm.SKIP, response_body_mode=pm.STREAMED,
                           request_trailer_mode=pm.SKIP, response_trailer_mode=pm.SKIP),
        response_attributes=list(METER_ATTRIBUTES),
    )


STREAM_FILTER = "llmgw.streams"


def _stream_filter() -> ext_proc_pb2.ExternalProcessor:
    """Streams only (their own admitted route): each SSE chunk waits for ext_proc, which passes whole
    events on, withholds the usage chunk it asked for on the client's behalf, ends a broken stream with
    the contract's `stream_interrupted` event, and settles. A chunk waits one local round trip (tokens
    are tens of milliseconds apart). If ext_proc fails, the stream continues unguarded (the lease and
    the sweeper still settle it)."""
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(Role.STREAMS),
        failure_mode_allow=True,
        processing_mode=pm(request_header_mode=pm.SKIP, request_body_mode=pm.NONE,
                           response_header_mode=pm.SKIP, response_body_mode=pm.STREAMED,
                           request_trailer_mode=pm.SKIP, response_trailer_mode=pm.SKIP),
        response_attributes=list(METER_ATTRIBUTES),
        message_timeout=duration_ms(500),
        # The running chunk count, read by the settlement log when Envoy cuts a stream.
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(untyped=[METADATA_NAMESPACE])),
    )


LUA_STREAM_GUARD = "llmgw.lua_streams"
LUA_SOURCE = Path(__file__).with_name("lua") / "stream_guard.lua"


def _lua_string(s: str) -> str:
    """A Lua long string holding s exactly (its level chosen so s cannot close it)."""
    level = 0
    while f"]{'=' * level}]" in s:
        level += 1
    eq = "=" * level
    return f"[{eq}[{s}]{eq}]" if not s.startswith("\n") else f"[{eq}[\n{s}]{eq}]"


def stream_guard_lua() -> str:
    """The Lua stream guard's source: its CONFIG (names from extproc/names.py, the contract's events
    from extproc/contract.py) and then llmgw/lua/stream_guard.lua."""
    keys = ", ".join(f"{k.name.lower()} = {_lua_string(k.value)}" for k in Key)
    events = ", ".join(f"{end.value} = {_lua_string(interrupted_event(message).decode())}"
                       for end, message in INTERRUPTED.items())
    config = (f"CONFIG = {{namespace = {_lua_string(METADATA_NAMESPACE)}, settle_stream = {_lua_string(Settle.STREAM)},"
              f" max_event_bytes = {MAX_EVENT_BYTES},\n  keys = {{{keys}}},\n  events = {{{events}}}}}\n")
    return config + LUA_SOURCE.read_text()


def _lua_stream_guard() -> lua_pb2.Lua:
    """Streams (their own admitted route): every chunk passes through LuaJIT in Envoy, never a round
    trip to ext_proc; the script does what extproc/streams.py does for idempotent streams, and leaves
    settlement to the access log (llmgw/lua/stream_guard.lua)."""
    return lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=stream_guard_lua()))


def _http_filter(name: str, msg: object, disabled: bool = False) -> hcm_pb2.HttpFilter:
    return hcm_pb2.HttpFilter(name=name, typed_config=pack(msg), disabled=disabled)


def _direct(status: int, code: ErrorCode, message: str) -> route_components_pb2.DirectResponseAction:
    body = json.dumps({"error": {"message": message, "type": code.error_type, "code": code.value,
                                 "param": None}})
    return route_components_pb2.DirectResponseAction(status=status, body=base_pb2.DataSource(inline_string=body))


def _ext_proc_disabled() -> dict[str, any_pb2.Any]:
    return {"envoy.filters.http.ext_proc": pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_meter()}


def _no_meter() -> dict[str, any_pb2.Any]:
    """Only admitted routes carry a reservation to settle. (Harmless where no meter is rendered.)"""
    return {METER_FILTER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_stream_guard()}


def _no_stream_guard() -> dict[str, any_pb2.Any]:
    return {STREAM_FILTER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_lua_guard()}


def _no_lua_guard() -> dict[str, any_pb2.Any]:
    return {LUA_STREAM_GUARD: pack(lua_pb2.LuaPerRoute(disabled=True))}


def meters(snap: Snapshot) -> bool:
    return any(r.budget_reservation != "off" for r in snap.routes.values())


USAGE_FIELDS = ((Key.USAGE_PROMPT, ("usage", "prompt_tokens")), (Key.USAGE_COMPLETION, ("usage", "completion_tokens")),
                (Key.USAGE_CACHED, ("usage", "prompt_tokens_details", "cached_tokens")))


def _usage_to_metadata() -> json_to_metadata_pb2.JsonToMetadata:
    """A JSON answer's `usage` into io.llmgw metadata, where the access log carries it to settlement."""
    j = json_to_metadata_pb2.JsonToMetadata
    rules = [j.Rule(selectors=[j.Selector(key=k) for k in path],
                    on_present=j.KeyValuePair(metadata_namespace=METADATA_NAMESPACE, key=key, type=j.NUMBER))
             for key, path in USAGE_FIELDS]
    # Engines answer `application/json` (vLLM) or with a charset (`application/json; charset=utf-8`).
    return j(response_rules=j.MatchRules(rules=rules, allow_content_types_regex=regex_pb2.RegexMatcher(
        regex=r"^application/json(\s*;.*)?$")))


def _settlement_log() -> accesslog_pb2.AccessLog:
    """Settlement from Envoy's gRPC access log: entries (with the io.llmgw metadata, usage included)
    stream to ext_proc in batches over one long-lived stream, instead of a stream per request. Every
    admitted request is sent: JSON answers settle here; a stream or idempotent answer that failed or
    was cut settles here at once; one that ended normally is settled by its own filter, and here only
    as a backstop (extproc/settlement.py). The first settlement wins."""
    # Every request that holds a reservation (its metadata says how it settles).
    which = accesslog_pb2.AccessLogFilter(metadata_filter=accesslog_pb2.MetadataFilter(
        matcher=metadata_pb2.MetadataMatcher(filter=METADATA_NAMESPACE,
                                             path=[metadata_pb2.MetadataMatcher.PathSegment(key=Key.SETTLE)],
                                             value=value_pb2.ValueMatcher(present_match=True))))
    config = als_pb2.HttpGrpcAccessLogConfig(common_config=als_pb2.CommonGrpcAccessLogConfig(
        log_name="llmgw-settlement", transport_api_version=config_source_pb2.V3,
        grpc_service=_extproc_service(),
        buffer_flush_interval=duration_ms(20), buffer_size_bytes=wrappers_pb2.UInt32Value(value=65536)),
        additional_response_headers_to_log=[ANSWERED_BY])
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=which,
        typed_config=pack(config))


def _route_config(snap: Snapshot, clusters: Iterable[str]) -> route_pb2.RouteConfiguration:
    stream_idle_ms = snap.gateway.envoy.stream_idle_timeout_ms
    # Envoy's own answers name the revision it was rendered from (ext_proc's name the one it decided
    # under, which a hot reload may have moved on).
    own = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", value="application/json")),
           base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=REVISION_HEADER, value=snap.revision))]
    ext_proc_by_headers = {"envoy.filters.http.ext_proc": pack(ext_proc_pb2.ExtProcPerRoute(
        overrides=ext_proc_pb2.ExtProcOverrides(processing_mode=processing_mode_pb2.ProcessingMode(
            request_header_mode=processing_mode_pb2.ProcessingMode.SEND,
            request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
            response_header_mode=processing_mode_pb2.ProcessingMode.SKIP)))), **_no_meter()}
    routes = [
        route_components_pb2.Route(
            name="healthz", match=route_components_pb2.RouteMatch(path="/healthz"),
            direct_response=route_components_pb2.DirectResponseAction(
                status=200, body=base_pb2.DataSource(inline_string='{"status":"ok"}')),
            response_headers_to_add=own, typed_per_filter_config=_ext_proc_disabled()),
        # GET /v1/models and /v1/models/{route} have no body: ext_proc takes their headers and answers
        # them; this is never reached.
        route_components_pb2.Route(
            name="models", match=route_components_pb2.RouteMatch(path_separated_prefix=MODELS_PATH),
            direct_response=_direct(503, ErrorCode.POLICY_UNAVAILABLE, "the model list is unavailable"),
            response_headers_to_add=own, typed_per_filter_config=ext_proc_by_headers),
    ]
    # Admitted requests: only ext_proc can set this metadata, so nothing else ever matches these. A
    # request ext_proc marked `settle: stream` (streams) or `settle: metered` (idempotent JSON) takes
    # the route where its response filter is on; every other admitted request settles through the
    # access log.
    def md(key: str, value: str) -> metadata_pb2.MetadataMatcher:
        return metadata_pb2.MetadataMatcher(filter=METADATA_NAMESPACE,
                                            path=[metadata_pb2.MetadataMatcher.PathSegment(key=key)],
                                            value=_string_value_matcher(value))
    for cluster in clusters:
        for kind in (Settle.STREAM, Settle.KEPT_STREAM, Settle.METERED, Settle.ACCESS_LOG):
            # Idempotent streams: ext_proc's stream guard. Idempotent JSON: the meter. Streams: the Lua
            # stream guard only (it reads `settle` itself). Other JSON: none of them.
            no_meter = {METER_FILTER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))}
            per_route = {Settle.STREAM: {**no_meter, STREAM_FILTER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))},
                         Settle.KEPT_STREAM: {**no_meter, **_no_lua_guard()},
                         Settle.METERED: _no_stream_guard()}.get(kind, _no_meter())
            streamed = kind in (Settle.STREAM, Settle.KEPT_STREAM)
            routes.append(route_components_pb2.Route(
                name=f"admitted_{cluster}" + ("" if kind is Settle.ACCESS_LOG else f"_{kind}"),
                match=route_components_pb2.RouteMatch(prefix="/v1/", dynamic_metadata=[
                    md(Key.CLUSTER, cluster), *([] if kind is Settle.ACCESS_LOG else [md(Key.SETTLE, kind)])]),
                route=route_components_pb2.RouteAction(
                    # A JSON answer is silent until generated: its bound is the deadline. A stream's
                    # silence is bounded per attempt (and an attempt silent before its first byte may
                    # be retried or fall back, when ext_proc's retry policy says `reset`).
                    cluster=cluster, timeout=duration_ms(0),
                    idle_timeout=duration_ms(stream_idle_ms if streamed else 300_000),
                    # No retries of its own: each request's come from ext_proc (x-envoy-retry-on and
                    # x-envoy-max-retries, set after the decision). A retry goes to another engine.
                    retry_policy=route_components_pb2.RetryPolicy(
                        per_try_idle_timeout=duration_ms(stream_idle_ms) if streamed else None,
                        num_retries=wrappers_pb2.UInt32Value(value=0),
                        retry_host_predicate=[route_components_pb2.RetryPolicy.RetryHostPredicate(
                            name="envoy.retry_host_predicates.previous_hosts",
                            typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()))],
                        host_selection_retry_max_attempts=3),
                ),
                # The caller's gateway credential never travels upstream (the header allow-list drops
                # it too; this holds even where a mesh operator leaves that filter out).
                request_headers_to_remove=["authorization"],
                response_headers_to_remove=[] if cluster.startswith("fallback_") else [ANSWERED_BY],
                typed_per_filter_config={**_admitted_route_filters(), **per_route}))
    routes += [
        # The route a chat completion matches when it arrives, before ext_proc decides: it turns the
        # response filters on (their per-route switches on the admitted route then decide). It is
        # what such a request meets only when ext_proc never saw it: one without a body.
        route_components_pb2.Route(
            name="chat_without_body", match=route_components_pb2.RouteMatch(path=CHAT_PATH),
            direct_response=_direct(400, ErrorCode.INVALID_REQUEST, "a JSON request body is required"),
            response_headers_to_add=own, typed_per_filter_config=_response_filters_on(snap)),
        # Everything else, /v1/* included: no such endpoint, answered without asking ext_proc.
        route_components_pb2.Route(
            name="not_found", match=route_components_pb2.RouteMatch(prefix="/"),
            direct_response=_direct(404, ErrorCode.ROUTE_NOT_FOUND, "no such endpoint"),
            response_headers_to_add=own, typed_per_filter_config=_ext_proc_disabled()),
    ]
    return route_pb2.RouteConfiguration(name="llmgw", virtual_hosts=[route_components_pb2.VirtualHost(
        name="llmgw", domains=["*"], routes=routes, include_attempt_count_in_response=True,
        include_request_attempt_count=True)])


def _response_filters_on(snap: Snapshot) -> dict[str, any_pb2.Any]:
    """Turn on the response filters that are off by default (where a gateway renders them). Envoy
    refuses an empty per-route config, so each repeats a setting its filter already has."""
    if not meters(snap):
        return {}
    on = pack(route_components_pb2.FilterConfig(disabled=False, config=pack(ext_proc_pb2.ExtProcPerRoute(
        overrides=ext_proc_pb2.ExtProcOverrides(failure_mode_allow=wrappers_pb2.BoolValue(value=True))))))
    # The Lua filter joins the chain here, its script off on this route: it runs on the stream route
    # ext_proc's decision then selects, and on no other (_no_lua_guard).
    lua_on = pack(route_components_pb2.FilterConfig(disabled=False, config=pack(lua_pb2.LuaPerRoute(disabled=True))))
    return {METER_FILTER: on, STREAM_FILTER: on, LUA_STREAM_GUARD: lua_on}


def _string_value_matcher(s: str) -> value_pb2.ValueMatcher:
    return value_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(exact=s))


def _access_log() -> accesslog_pb2.AccessLog:
    ns = METADATA_NAMESPACE
    fmt = struct_pb2.Struct()
    fmt.update({
        "time": "%START_TIME%", "request_id": "%REQ(X-REQUEST-ID)%", "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH):256%", "status": "%RESPONSE_CODE%", "details": "%RESPONSE_CODE_DETAILS%",
        "flags": "%RESPONSE_FLAGS%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
        "upstream": "%UPSTREAM_HOST%", "duration_ms": "%DURATION%",
        "tenant": f"%DYNAMIC_METADATA({ns}:tenant)%", "route": f"%DYNAMIC_METADATA({ns}:route)%",
        "deployment": f"%DYNAMIC_METADATA({ns}:deployment)%",  # the first candidate of the plan
        "answered_by": f"%RESP({ANSWERED_BY})%",  # the candidate that answered (fallback: maybe another)
        "revision": f"%DYNAMIC_METADATA({ns}:revision)%",
        "subject": f"%DYNAMIC_METADATA({ns}:subject)%",
        "decision": f"%DYNAMIC_METADATA({ns}:decision)%",
        "reasons": f"%DYNAMIC_METADATA({ns}:reasons)%",
        "redactions": f"%DYNAMIC_METADATA({ns}:redactions)%",
        "picked": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{LB_KEY})%",
    })
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout", typed_config=pack(
        stream_pb2.StdoutAccessLog(log_format=substitution_format_string_pb2.SubstitutionFormatString(
            json_format=fmt))))


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
        route_config=_route_config(snap, clusters),
        local_reply_config=_local_reply_config(snap.revision),
        access_log=[*([_access_log()] if access_log else []), *([_settlement_log()] if meters(snap) else [])],
        http_filters=[
            _http_filter("envoy.filters.http.header_mutation", _header_mutation_filter()),
            _http_filter("envoy.filters.http.ext_proc", _ext_proc_filter(snap)),
            _http_filter("envoy.filters.http.buffer", buffer_pb2.Buffer(
                max_request_bytes=wrappers_pb2.UInt32Value(value=env.max_request_bytes))),
            # Only a gateway whose routes reserve budgets has anything to settle. After the buffer, so
            # the meter reads its per-route switch on the route ext_proc's decision selected. Off
            # unless the route a request matched first turns them on (chat completions): so Envoy's
            # own replies (a malformed request, a header too large) never wait for them.
            *([_http_filter(METER_FILTER, _meter_filter(snap), disabled=True),
               _http_filter(STREAM_FILTER, _stream_filter(), disabled=True),
               _http_filter(LUA_STREAM_GUARD, _lua_stream_guard(), disabled=True),
               _http_filter("envoy.filters.http.json_to_metadata", _usage_to_metadata())] if meters(snap) else []),
            _http_filter(UPSTREAM_HEADERS_FILTER, _upstream_headers_filter()),
            _http_filter("envoy.filters.http.custom_response", custom_response_pb2.CustomResponse()),
            _http_filter("envoy.filters.http.router", router_pb2.Router()),
        ],
    )


PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _protocol_options(http2: bool) -> dict[str, any_pb2.Any]:
    opts = http_protocol_options_pb2.HttpProtocolOptions
    explicit = (opts.ExplicitHttpConfig(http2_protocol_options=protocol_pb2.Http2ProtocolOptions(
        max_concurrent_streams=wrappers_pb2.UInt32Value(value=100_000)))
                if http2 else opts.ExplicitHttpConfig(http_protocol_options=protocol_pb2.Http1ProtocolOptions()))
    return {PROTOCOL_OPTIONS: pack(opts(explicit_http_config=explicit))}




def _attempt_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    """ext_proc once per attempt (an upstream filter): which candidate this attempt goes to, its body
    and credential, and the attempt's record (extproc/attempts.py). Fails closed: an attempt that
    cannot be addressed is not sent."""
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(Role.ATTEMPT),
        failure_mode_allow=False,
        processing_mode=pm(request_header_mode=pm.SEND, request_body_mode=pm.BUFFERED,
                           response_header_mode=pm.SEND, response_body_mode=pm.NONE,
                           request_trailer_mode=pm.SKIP, response_trailer_mode=pm.SKIP),
        # An attempt whose body needs no rewrite (its candidate serves the first's model) skips the
        # body message: the headers reply overrides the mode to this one.
        allow_mode_override=True,
        allowed_override_modes=[processing_mode_pb2.ProcessingMode(**ATTEMPT_WITHOUT_BODY)],
        request_attributes=list(ATTEMPT_ATTRIBUTES),
        message_timeout=duration_ms(snap.gateway.envoy.extproc_message_timeout_ms),
    )


def _attempt_filters(snap: Snapshot) -> dict[str, any_pb2.Any]:
    """The upstream filter chain of a composite cluster: Envoy builds it from the routed cluster (the
    composite), whichever sub-cluster's host an attempt goes to."""
    opts = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()),
        http_filters=[hcm_pb2.HttpFilter(name="llmgw.attempt", typed_config=pack(_attempt_filter(snap))),
                      hcm_pb2.HttpFilter(name="envoy.filters.http.upstream_codec",
                                         typed_config=pack(upstream_codec_pb2.UpstreamCodec()))])
    return {PROTOCOL_OPTIONS: pack(opts)}


def _composite_config_class() -> type[Message]:
    """envoy.extensions.clusters.composite.v3.ClusterConfig, which xds-protos does not ship yet:
    declared here (two fields) so the bootstrap stays built from typed messages."""
    name = "envoy.extensions.clusters.composite.v3.ClusterConfig"
    pool = descriptor_pool.Default()
    try:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto(name="llmgw/composite_cluster.proto",
                                             package="envoy.extensions.clusters.composite.v3", syntax="proto3")
    cfg = fdp.message_type.add(name="ClusterConfig")
    entry = cfg.nested_type.add(name="ClusterEntry")
    fd = descriptor_pb2.FieldDescriptorProto
    entry.field.add(name="name", number=1, type=fd.TYPE_STRING, label=fd.LABEL_OPTIONAL, json_name="name")
    cfg.field.add(name="clusters", number=1, type=fd.TYPE_MESSAGE, label=fd.LABEL_REPEATED,
                  type_name=".envoy.extensions.clusters.composite.v3.ClusterConfig.ClusterEntry",
                  json_name="clusters")
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))


def _composite_cluster(snap: Snapshot, name: str, sub_clusters: Iterable[str]) -> cluster_pb2.Cluster:
    """Attempt N goes to sub-cluster N (Envoy's composite cluster)."""
    config_class = _composite_config_class()
    config = config_class(clusters=[config_class.ClusterEntry(name=c) for c in sub_clusters])
    return cluster_pb2.Cluster(
        name=name, connect_timeout=duration_ms(1000), lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
        cluster_type=cluster_pb2.Cluster.CustomClusterType(name="envoy.clusters.composite", typed_config=pack(config)),
        circuit_breakers=_thresholds(snap.gateway.envoy.max_concurrent_retries),
        typed_extension_protocol_options=_attempt_filters(snap))


def fallback_clusters(snap: Snapshot, known: set[str]) -> list[cluster_pb2.Cluster]:
    """For each route with several candidates: a composite cluster per ordered subset of them, so that
    whichever qualify for a request, its cluster holds exactly those. A route with fallback off sends
    one candidate at most: only its credentialed candidates need one (alone)."""
    composites: list[cluster_pb2.Cluster] = []
    for route in snap.routes.values():
        clusters = [snap.pool_of(snap.deployments[c.deployment_name]) if c.deployment_name in snap.deployments
                    else "" for c in route.candidates]
        credentialed = [i for i, c in enumerate(route.candidates)
                        if (d := snap.deployments.get(c.deployment_name)) is not None and d.credential_ref]
        for subset in candidate_subsets(len(clusters), credentialed):
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


def _outlier_detection(consecutive: int, base_ms: int, max_percent: int) -> outlier_detection_pb2.OutlierDetection:
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
    kind = cluster_pb2.Cluster.STATIC if all(_is_ip(h) for h, _ in hosts) else cluster_pb2.Cluster.STRICT_DNS
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


def _pool_cluster(name: str, pool: str, settings: Pool, hosts: Iterable[tuple[str, int]],
                  lb: str = "picker") -> cluster_pb2.Cluster:
    cluster = static_cluster(name, hosts, http2=False, connect_ms=settings.connect_timeout_ms, metadata={"pool": pool},
                             max_retries=settings.max_retries)
    o = settings.outlier
    cluster.outlier_detection.CopyFrom(_outlier_detection(o.consecutive_failures, o.base_ejection_ms,
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


def render_bootstrap(snap: Snapshot, opts: RenderOptions) -> bootstrap_pb2.Bootstrap:
    pool_clusters = {f"pool_{name}": name for name in snap.gateway.pools}
    clusters = [static_cluster(EXTPROC_CLUSTER, opts.extproc, http2=True, connect_ms=1000)]
    # A worker that is down (restarting) leaves rotation at its first refused connection, so the
    # others take the decisions; at most half are ever ejected.
    clusters[0].outlier_detection.CopyFrom(_outlier_detection(1, 1000, 50))
    if opts.tls.extproc is not None:
        clusters[0].transport_socket.CopyFrom(_extproc_mtls(opts.tls.extproc))
    for cluster_name, pool in pool_clusters.items():
        hosts = opts.pools.get(pool) or tuple(_hp(e) for e in snap.gateway.pools[pool].endpoints)
        clusters.append(_pool_cluster(cluster_name, pool, snap.gateway.pools[pool], hosts, opts.pool_lb))
    for dep in snap.deployments.values():
        if dep.endpoints:
            clusters.append(static_cluster(snap.pool_of(dep), (_hp(e) for e in dep.endpoints),
                                           http2=False, connect_ms=1000,
                                           max_retries=snap.gateway.envoy.max_concurrent_retries))
    upstream = [c.name for c in clusters[1:]]
    fallbacks = fallback_clusters(snap, set(upstream))
    clusters += fallbacks
    hcm = _hcm(snap, upstream + [c.name for c in fallbacks], opts.access_log)
    listener = listener_pb2.Listener(
        name="llmgw", address=socket_address(*opts.listen),
        per_connection_buffer_limit_bytes=wrappers_pb2.UInt32Value(value=snap.gateway.envoy.max_request_bytes),
        filter_chains=[listener_components_pb2.FilterChain(filters=[listener_components_pb2.Filter(
            name="envoy.filters.network.http_connection_manager", typed_config=pack(hcm))])])
    if opts.tls.listener is not None:
        listener.filter_chains[0].transport_socket.CopyFrom(_listener_tls(opts.tls.listener))
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
        admin=bootstrap_pb2.Admin(address=socket_address(*opts.admin)),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(listeners=[listener], clusters=clusters),
    )


def render_yaml(snap: Snapshot, opts: RenderOptions) -> str:
    # Through JSON so that Any payloads become plain dicts YAML can write; sorted so renders are stable.
    doc = json.loads(json_format.MessageToJson(render_bootstrap(snap, opts), preserving_proto_field_name=True,
                                               sort_keys=True))  # map order is not stable otherwise
    header = f"# Rendered by `llmgw envoy render` from policy revision {snap.revision}. Do not edit.\n"
    return header + yaml.safe_dump(doc, sort_keys=False, width=120)
