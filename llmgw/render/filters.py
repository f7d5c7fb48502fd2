"""The HTTP filters of the listener's chain (and the attempt filter of composite clusters): ext_proc
for the decision, the meter and ext_proc's stream guard, the Lua stream guard, header mutations,
json_to_metadata, and the access logs (the settlement log among them)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2, config_source_pb2, grpc_service_pb2, substitution_format_string_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2, value_pb2
from google.protobuf import struct_pb2, wrappers_pb2

import extproc
from extproc.config import Snapshot
from extproc.contract import (
    METADATA_NAMESPACE,
    REVISION_HEADER,
    ROLE_KEY,
    SHOULD_RETRY_HEADER,
    ErrorCode,
    GatewayError,
    Role,
    interrupted_event,
)
from extproc.names import (
    ATTEMPT_ATTRIBUTES,
    ATTEMPT_COUNT_HEADER,
    ATTEMPT_WITH_BODY,
    ATTEMPT_WITHOUT_BODY,
    EXTPROC_CLUSTER,
    EXTPROC_FAILED,
    INTERRUPTED,
    KEEPALIVE,
    LB_KEY,
    LB_NAMESPACE,
    MAX_EVENT_BYTES,
    METER_ATTRIBUTES,
    PRICED_APART,
    UPSTREAM_REQUEST_ID_HEADERS,
    USAGE_COUNTS,
    Header,
    Key,
    Settle,
    request_attributes,
)
from extproc.shapes.registry import CREDENTIAL_HEADERS, CREDENTIAL_QUERY, SHAPES
from llmgw.render.common import cel_filter, duration_ms, pack

# The contract's response headers, from the metadata ext_proc returned with its decision.
ANSWER_HEADERS: tuple[tuple[str, str], ...] = (
    (REVISION_HEADER, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.REVISION})%"),
    (Header.DEPLOYMENT, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.DEPLOYMENT})%"),
    (Header.ATTEMPTS, "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"),
    # Only on an answer the route's degraded route gave (empty, so left out, otherwise).
    (Header.DEGRADED, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.DEGRADED})%"),
    # What translating to a lone candidate lost (the attempt filter names it for a plan of several).
    (Header.TRANSLATION_LOSS, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.TRANSLATION_LOSS})%"),
)
ADDED_IF_ABSENT = (Header.DEPLOYMENT, Header.TRANSLATION_LOSS)  # the attempt filter's, where it ran


def upstream_answer_headers(errors: bool = False) -> list[base_pb2.HeaderValueOption]:
    """x-llmgw-deployment only where absent: on a fallback route the attempt filter named the candidate
    that answered; every other admitted route removes whatever an upstream sent under that name. An
    upstream error rewritten into the contract (`errors`, one copy per route and status) leaves out
    x-llmgw-degraded: the ledger says it, and the copies would grow Envoy's config by a tenth."""
    hvo = base_pb2.HeaderValueOption
    return [hvo(header=base_pb2.HeaderValue(key=k, value=v),
                append_action=hvo.ADD_IF_ABSENT if k in ADDED_IF_ABSENT else hvo.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in ANSWER_HEADERS if not (errors and k in (Header.DEGRADED, Header.TRANSLATION_LOSS))]




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
    ("traceparent", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.TRACEPARENT})%"),
    ("tracestate", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.TRACESTATE})%"),
    ("x-envoy-upstream-rq-timeout-ms", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.RQ_TIMEOUT_MS})%"),
    ("x-envoy-upstream-rq-per-try-timeout-ms", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.PER_TRY_TIMEOUT_MS})%"),
    # The retry policy ext_proc chose for this request (extproc/stages/retry.py); Envoy's router is
    # the one retry owner, and the route itself allows none.
    ("x-envoy-retry-on", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.RETRY_ON})%"),
    ("x-envoy-retriable-status-codes", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.RETRIABLE_CODES})%"),
    ("x-envoy-max-retries", f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.MAX_RETRIES})%"),
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


def upstream_headers_filter() -> header_mutation_pb2.HeaderMutation:
    hvo = base_pb2.HeaderValueOption
    strip = mutation_rules_pb2.HeaderMutation(remove_on_match=mutation_rules_pb2.HeaderMutation.RemoveOnMatch(
        key_matcher=string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(
            regex=names_outside(FORWARDED_HEADERS)))))
    return header_mutation_pb2.HeaderMutation(mutations=header_mutation_pb2.Mutations(request_mutations=[
        strip, *(mutation_rules_pb2.HeaderMutation(append=hvo(
            header=base_pb2.HeaderValue(key=k, value=v), append_action=hvo.OVERWRITE_IF_EXISTS_OR_ADD))
            for k, v in DECISION_HEADERS)],
        # A front door's key in the query string (Gemini's `?key=`) never travels upstream either.
        query_parameter_mutations=[base_pb2.KeyValueMutation(remove=name) for name in CREDENTIAL_QUERY]))


def header_mutation_filter() -> header_mutation_pb2.HeaderMutation:
    return header_mutation_pb2.HeaderMutation(mutations=header_mutation_pb2.Mutations(response_mutations=[
        mutation_rules_pb2.HeaderMutation(append=h) for h in upstream_answer_headers()]))




def _extproc_service(role: Role | None = None) -> grpc_service_pb2.GrpcService:
    """The ext_proc cluster, for every filter and the access log that talk to it; `role` (gRPC
    metadata) tells ext_proc which kind of stream starts (extproc/service/processor.py dispatches on it)."""
    service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EXTPROC_CLUSTER))
    if role is not None:
        service.initial_metadata.append(base_pb2.HeaderValue(key=ROLE_KEY, value=role.value))
    return service


def longest_decision_ms(snap: Snapshot) -> int:
    """The longest Envoy may be asked to wait for a decision: the longest queue TTL of a class, plus
    the message timeout."""
    ttl = max((c.queue_ttl_ms for c in snap.gateway.request_classes.values()), default=0)
    return ttl + snap.gateway.envoy.extproc_message_timeout_ms


def ext_proc_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(),
        failure_mode_allow=False,
        # One message per request: the buffered body, with the headers ext_proc needs as attributes.
        # Header mode SKIP lets the headers pass ext_proc at once; the buffer filter after it holds them
        # until the body (and so ext_proc's decision) is through, so the router never routes early.
        processing_mode=pm(request_header_mode=pm.SKIP, request_body_mode=pm.BUFFERED,
                           response_header_mode=pm.SKIP, response_body_mode=pm.NONE),
        request_attributes=list(request_attributes(CREDENTIAL_HEADERS)),
        message_timeout=duration_ms(snap.gateway.envoy.extproc_message_timeout_ms),
        # A request queued for admission (extproc/admission.py) asks Envoy once to wait for its decision
        # as long as its class's queue TTL, plus the message timeout for the rest of the decision.
        max_message_timeout=duration_ms(longest_decision_ms(snap)),
        mutation_rules=mutation_rules_pb2.HeaderMutationRules(allow_envoy=wrappers_pb2.BoolValue(value=True)),
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[METADATA_NAMESPACE, "envoy.lb"])),
    )




def meter_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    """Idempotent JSON answers (their own admitted route): each body chunk waits for ext_proc, which
    holds the last until the answer is recorded for replay and settled, so a repeat of the key that
    follows the answer is replayed (extproc/settlement/). If ext_proc fails, the answer continues
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




def stream_filter() -> ext_proc_pb2.ExternalProcessor:
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




LUA_DIR = Path(extproc.__file__).with_name("lua")  # the data plane's: Envoy runs it on every request
SHAPES_DIR = Path(extproc.__file__).with_name("shapes")  # each shape's own Lua, in its folder


def _lua_string(s: str) -> str:
    """A Lua long string holding s exactly (its level chosen so s cannot close it)."""
    level = 0
    while f"]{'=' * level}]" in s:
        level += 1
    eq = "=" * level
    return f"[{eq}[{s}]{eq}]" if not s.startswith("\n") else f"[{eq}[\n{s}]{eq}]"


def _lua_table(values: Mapping[str, str] | Mapping[int, str]) -> str:
    return "{" + ", ".join(f"[ {k if isinstance(k, int) else _lua_string(k)} ] = {_lua_string(v)}"
                           for k, v in values.items()) + "}"


def _lua_script(script: str, config: Mapping[str, str], helpers: tuple[str, ...] = (),
                parts: tuple[str, ...] = ()) -> str:
    """A Lua filter's source: its CONFIG (`config`'s Lua expressions, with the metadata namespace, the
    io.llmgw key names from extproc/names.py and the SSE event size bound), the JSON and SSE helpers
    (extproc/lua/json.lua, sse.lua) and any other `helpers`, then the script, with the shapes' `parts`
    (extproc/shapes/<shape>/<part>) where its `-- @shapes` line stands."""
    keys = ", ".join(f"{k.name.lower()} = {_lua_string(k.value)}" for k in Key)
    fields = "".join(f", {name} = {value}" for name, value in config.items())
    body = (LUA_DIR / script).read_text()
    if parts:
        assert body.count("\n-- @shapes\n") == 1, script
        body = body.replace("\n-- @shapes\n", "\n" + "".join((SHAPES_DIR / p).read_text() for p in parts))
    return (f"CONFIG = {{namespace = {_lua_string(METADATA_NAMESPACE)}, max_event_bytes = {MAX_EVENT_BYTES}, "
            f"should_retry_header = {_lua_string(SHOULD_RETRY_HEADER)}{fields},\n  keys = {{{keys}}}}}\n"
            + "".join((LUA_DIR / name).read_text() for name in ("json.lua", "sse.lua", *helpers)) + body)


def stream_guard_lua() -> str:
    """The Lua stream guard's source (extproc/lua/stream_guard.lua), with the contract's events."""
    events = {end.value: interrupted_event(message).decode() for end, message in INTERRUPTED.items()}
    return _lua_script("stream_guard.lua", {
        "settle_stream": _lua_string(Settle.STREAM), "degraded_header": _lua_string(Header.DEGRADED),
        "events": _lua_table(events), "keepalive": _lua_string(KEEPALIVE.decode()),
        "priced_apart": _lua_table({key.value: path[-1] for key, path in USAGE_COUNTS if key in PRICED_APART})})


def lua_stream_guard() -> lua_pb2.Lua:
    """Streams (their own admitted route): every chunk passes through LuaJIT in Envoy, never a round
    trip to ext_proc; the script does what extproc/service/streams.py does for idempotent streams, and leaves
    settlement to the access log (extproc/lua/stream_guard.lua)."""
    return lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=stream_guard_lua()))




def _lua_names(names: Iterable[str]) -> str:
    return "{" + ", ".join(_lua_string(n) for n in names) + "}"


def answers_lua() -> str:
    """The Lua answer filter's source (extproc/lua/answers.lua, with extproc/lua/eventstream.lua for
    Bedrock's streams), with the shapes it translates and their tables (stop reasons) from the shapes
    registry, and the contract's 502 for an answer that does not parse."""
    broken = GatewayError(ErrorCode.UPSTREAM_ERROR, "the provider's answer is broken").body()
    tables = {name: _lua_table(table) for shape in SHAPES for name, table in shape.answer_tables.items()}
    return _lua_script("answers.lua", {
        "loss_header": _lua_string(Header.TRANSLATION_LOSS), "degraded_header": _lua_string(Header.DEGRADED),
        "shape_header": _lua_string(Header.ANSWER_SHAPE), "model_header": _lua_string(Header.ANSWER_MODEL),
        "broken": _lua_string(broken.decode()), **tables,
        "interrupted": _lua_string(interrupted_event("the provider's stream broke").decode()),
        "keepalive": _lua_string(KEEPALIVE.decode()),
        "answer_shapes": _lua_names(s.name for s in SHAPES if s.lua_answers),
        "stream_shapes": _lua_names(s.name for s in SHAPES if s.lua_streams)},
        helpers=("values.lua", "eventstream.lua"),
        parts=tuple(f"{s.name}/answers.lua" for s in SHAPES if s.lua_answers or s.lua_streams))


def lua_answers() -> lua_pb2.Lua:
    """A lone candidate of another shape translated by the decision (extproc/direct.py): its headers
    set on the request, its answer (JSON or stream) translated back, in LuaJIT in Envoy
    (extproc/lua/answers.lua).
    The provider's path must not send the request to another route: the route cache is kept."""
    return lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=answers_lua()),
                       clear_route_cache=wrappers_pb2.BoolValue(value=False))


USAGE_FIELDS = (*((key, ("usage", *path)) for key, path in USAGE_COUNTS),
                (Key.UPSTREAM_ID, ("id",)), (Key.UPSTREAM_MODEL, ("model",)))


def usage_to_metadata() -> json_to_metadata_pb2.JsonToMetadata:
    """A JSON answer's `usage` into io.llmgw metadata, where the access log carries it to settlement.
    Each value keeps its JSON type (NUMBER would turn a string "7" into a count, which no upstream
    sends): settlement believes only whole numbers (extproc/envoy_msgs.count_attr)."""
    j = json_to_metadata_pb2.JsonToMetadata
    rules = [j.Rule(selectors=[j.Selector(key=k) for k in path],
                    on_present=j.KeyValuePair(metadata_namespace=METADATA_NAMESPACE, key=key, type=j.PROTOBUF_VALUE))
             for key, path in USAGE_FIELDS]
    # Engines answer `application/json` (vLLM) or with a charset (`application/json; charset=utf-8`).
    return j(response_rules=j.MatchRules(rules=rules, allow_content_types_regex=regex_pb2.RegexMatcher(
        regex=r"^application/json(\s*;.*)?$")))


def settlement_log() -> accesslog_pb2.AccessLog:
    """Settlement from Envoy's gRPC access log: entries (with the io.llmgw metadata, usage included)
    stream to ext_proc in batches over one long-lived stream, instead of a stream per request. Every
    admitted request is sent: JSON answers settle here; a stream or idempotent answer that failed or
    was cut settles here at once; one that ended normally is settled by its own filter, and here only
    as a backstop (extproc/settlement/). The first settlement wins."""
    # Every request that holds a reservation (its metadata says how it settles), and every request Envoy
    # answered itself because no decision reached it (ext_proc failed or was too slow): a worker may
    # have reserved for it before the decision was lost, and nothing else would release that.
    holds = accesslog_pb2.AccessLogFilter(metadata_filter=accesslog_pb2.MetadataFilter(
        matcher=metadata_pb2.MetadataMatcher(filter=METADATA_NAMESPACE,
                                             path=[metadata_pb2.MetadataMatcher.PathSegment(key=Key.SETTLE)],
                                             value=value_pb2.ValueMatcher(present_match=True)),
        # Envoy logs an entry whose metadata lacks the key unless told not to: every health check, model
        # list and refusal went to settlement, which had nothing to do with them.
        match_if_key_not_found=wrappers_pb2.BoolValue(value=False)))
    which = accesslog_pb2.AccessLogFilter(or_filter=accesslog_pb2.OrFilter(filters=[
        holds, cel_filter(f"response.code_details.startsWith('{EXTPROC_FAILED}')")]))
    config = als_pb2.HttpGrpcAccessLogConfig(common_config=_settlement_stream(),
                                             additional_response_headers_to_log=[Header.DEPLOYMENT, Header.DEGRADED])
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=which,
        typed_config=pack(config))


def _settlement_stream() -> als_pb2.CommonGrpcAccessLogConfig:
    """The settlement log's stream. Envoy keeps one stream per worker thread for each such config, so
    the attempt log (the same config) shares it: a request's attempts reach ext_proc before its own
    entry, on the same stream, hence the same ext_proc worker."""
    return als_pb2.CommonGrpcAccessLogConfig(
        log_name="llmgw-settlement", transport_api_version=config_source_pb2.V3, grpc_service=_extproc_service(),
        buffer_flush_interval=duration_ms(20), buffer_size_bytes=wrappers_pb2.UInt32Value(value=65536))


def attempt_log() -> accesslog_pb2.AccessLog:
    """The router's log of each attempt that ended without an answer (no response headers: a reset, a
    timeout, a connection that failed) or with an error status: settlement charges the attempts before
    the answering one from it - one sent and never answered may have run, and is charged at its bound
    (invariant 23). An attempt answered 2xx is never logged here: the common path costs nothing. The
    entries carry no metadata of the request (an upstream request has its own), only its headers: its
    id and attempt number."""
    unanswered = accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(op=accesslog_pb2.ComparisonFilter.EQ,
                                                  value=base_pb2.RuntimeUInt32(default_value=0, runtime_key=""))))
    refused = accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(op=accesslog_pb2.ComparisonFilter.GE,
                                                  value=base_pb2.RuntimeUInt32(default_value=400, runtime_key=""))))
    config = als_pb2.HttpGrpcAccessLogConfig(common_config=_settlement_stream(),
                                             additional_request_headers_to_log=["x-request-id", ATTEMPT_COUNT_HEADER])
    return accesslog_pb2.AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=accesslog_pb2.AccessLogFilter(or_filter=accesslog_pb2.OrFilter(filters=[unanswered, refused])),
        typed_config=pack(config))


def stdout_access_log() -> accesslog_pb2.AccessLog:
    ns = METADATA_NAMESPACE
    fmt = struct_pb2.Struct()
    fmt.update({
        "time": "%START_TIME%", "request_id": "%REQ(X-REQUEST-ID)%", "method": "%REQ(:METHOD)%",
        # The client's path, never its query (a front door's key may be there: Gemini's `?key=`).
        "path": "%PATH(NQ:ORIG_OR_PATH):256%", "status": "%RESPONSE_CODE%", "details": "%RESPONSE_CODE_DETAILS%",
        "flags": "%RESPONSE_FLAGS%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
        "upstream": "%UPSTREAM_HOST%", "duration_ms": "%DURATION%",
        "tenant": f"%DYNAMIC_METADATA({ns}:{Key.TENANT})%", "route": f"%DYNAMIC_METADATA({ns}:{Key.ROUTE})%",
        "deployment": f"%DYNAMIC_METADATA({ns}:{Key.DEPLOYMENT})%",  # the first candidate of the plan
        "answered_by": f"%RESP({Header.DEPLOYMENT})%",  # the candidate that answered (fallback: maybe another)
        "revision": f"%DYNAMIC_METADATA({ns}:{Key.REVISION})%",
        "subject": f"%DYNAMIC_METADATA({ns}:{Key.SUBJECT})%",
        "decision": f"%DYNAMIC_METADATA({ns}:{Key.DECISION})%",
        "decision_id": f"%DYNAMIC_METADATA({ns}:{Key.DECISION_ID})%",
        "reasons": f"%DYNAMIC_METADATA({ns}:{Key.REASONS})%",
        "redactions": f"%DYNAMIC_METADATA({ns}:{Key.REDACTIONS})%",
        "picked": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{LB_KEY})%",
    })
    return accesslog_pb2.AccessLog(name="envoy.access_loggers.stdout", typed_config=pack(
        stream_pb2.StdoutAccessLog(log_format=substitution_format_string_pb2.SubstitutionFormatString(
            json_format=fmt))))


def attempt_filter(snap: Snapshot) -> ext_proc_pb2.ExternalProcessor:
    """ext_proc once per attempt (an upstream filter): which candidate this attempt goes to, its body
    and credential, and the attempt's record (extproc/service/attempts.py). Fails closed: an attempt that
    cannot be addressed is not sent."""
    pm = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=_extproc_service(Role.ATTEMPT),
        failure_mode_allow=False,
        # Never an answer's body (response_body_mode NONE): an upstream ext_proc filter whose side
        # stream crosses its buffer watermark while the upstream request ends crashes Envoy 1.40. A
        # translated answer is read by the Lua answer filter downstream instead.
        processing_mode=pm(**ATTEMPT_WITH_BODY),
        # An attempt whose body needs no rewrite (its candidate serves the first's model) skips the
        # body message: the headers reply overrides the mode to this one.
        allow_mode_override=True,
        allowed_override_modes=[pm(**ATTEMPT_WITHOUT_BODY)],
        request_attributes=list(ATTEMPT_ATTRIBUTES),
        message_timeout=duration_ms(snap.gateway.envoy.extproc_message_timeout_ms),
        # The attempt addresses its candidate: a provider whose signature covers the host (Bedrock's
        # SigV4) is sent its own authority, which ext_proc may set only with routing headers allowed.
        mutation_rules=mutation_rules_pb2.HeaderMutationRules(allow_all_routing=wrappers_pb2.BoolValue(value=True)),
    )




MAX_REASON_BYTES = 500  # an upstream's reason for refusing, as the caller and the ledger get it
MAX_REFUSAL_BYTES = 64 * 1024  # an upstream's refusal larger than this is no error document: its reason is not read


def upstream_status_lua(refusals: Mapping[int, tuple[int, str, str]]) -> str:
    """The Lua filter nearest the router (extproc/lua/upstream_status.lua): the upstream's own status
    and request id (UPSTREAM_REQUEST_ID_HEADERS) into the metadata, and an upstream's refusal's reason
    into the contract's error (`refusals`: each status -> the caller's, and the error body around it)."""
    table = "{" + ", ".join(f"[ {_lua_string(str(upstream))} ] = {{status = {_lua_string(str(status))}, "
                            f"before = {_lua_string(before)}, after = {_lua_string(after)}}}"
                            for upstream, (status, before, after) in sorted(refusals.items())) + "}"
    return _lua_script("upstream_status.lua", {
        "request_id_headers": _lua_names(UPSTREAM_REQUEST_ID_HEADERS), "refusals": table,
        "attempt_refused_header": _lua_string(Header.ATTEMPT_REFUSED),
        "max_reason_bytes": str(MAX_REASON_BYTES), "max_refusal_bytes": str(MAX_REFUSAL_BYTES)},
        helpers=("values.lua",))


def upstream_status(refusals: Mapping[int, tuple[int, str, str]]) -> lua_pb2.Lua:
    return lua_pb2.Lua(default_source_code=base_pb2.DataSource(inline_string=upstream_status_lua(refusals)))


DOORS_SCRIPT = "doors"  # its script's name: the routes that run it name it (LuaPerRoute.name)


def doors_lua() -> str:
    """The Lua door filter's source (extproc/lua/doors.lua), with each door's status names and stop
    reasons from its Python module (extproc/shapes/*/door.py) and the contract's codes."""
    doors = {shape.door.name: "{" + ", ".join(f"{k} = {_lua_table(v)}" for k, v in shape.door_tables.items()) + "}"
             for shape in SHAPES if shape.door is not None}
    return _lua_script("doors.lua", {
        **doors,
        "upstream_error": _lua_string(ErrorCode.UPSTREAM_ERROR.value),
        "stream_interrupted": _lua_string(ErrorCode.STREAM_INTERRUPTED.value),
        "count_fields": _lua_table({s.name: s.count_field for s in SHAPES if s.count_field}),
        "doors": _lua_names(doors)}, helpers=("values.lua",),
        parts=tuple(f"{s.name}/door.lua" for s in SHAPES if s.door is not None))


def lua_doors() -> lua_pb2.Lua:
    """A front door's answers in its caller's shape, in LuaJIT in Envoy (extproc/lua/doors.lua): before
    the decision filter, so it sees every answer last, errors included. No script by default: a door's
    routes name it, so it runs for those requests alone."""
    return lua_pb2.Lua(source_codes={DOORS_SCRIPT: base_pb2.DataSource(inline_string=doors_lua())})


def meters(snap: Snapshot) -> bool:
    """Whether the response filters that read answers are rendered: any route that reserves (its answers
    settle) or serves chat (its answers may be checked)."""
    return any(r.budget_reservation != "off" or r.serves == "chat" for r in snap.routes.values())
