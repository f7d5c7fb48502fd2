"""The route table: what an admitted request matches (ext_proc's metadata only), which response
filters each admitted route turns on, and Envoy's own answers for everything else."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.lua.v3 import lua_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import metadata_pb2, regex_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as matcher_pb2
from google.protobuf import any_pb2, wrappers_pb2

from extproc.config import Snapshot
from extproc.config.plans import can_count, composite_name, decision_translates, shape_headers, translated
from extproc.config.schema import MAX_RETRIES
from extproc.contract import CHAT_PATH, EMBEDDINGS_PATH, METADATA_NAMESPACE, MODELS_PATH, REVISION_HEADER, ErrorCode
from extproc.names import POOL_CLUSTER_PREFIX, SHADOW_CLUSTER, Filter, Header, Key, Settle
from extproc.shapes.registry import CREDENTIAL_HEADERS, DOORS, Door
from llmgw.render.common import duration_ms, pack, string_value_matcher
from llmgw.render.errors import direct
from llmgw.render.filters import DOORS_SCRIPT, meters


def _ext_proc_disabled() -> dict[str, any_pb2.Any]:
    return {Filter.EXT_PROC: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_meter()}


GET_ONLY = route_components_pb2.HeaderMatcher(name=":method", string_match=string_pb2.StringMatcher(exact="GET"))


def _no_meter() -> dict[str, any_pb2.Any]:
    """Only admitted routes carry a reservation to settle. (Harmless where no meter is rendered.)"""
    return {Filter.METER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_stream_guard()}


def _no_stream_guard() -> dict[str, any_pb2.Any]:
    return {Filter.STREAMS: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True)), **_no_lua_guard()}


def _no_lua_guard() -> dict[str, any_pb2.Any]:
    return {Filter.LUA_STREAM_GUARD: pack(lua_pb2.LuaPerRoute(disabled=True)), **_no_lua_answers()}


def _no_lua_answers() -> dict[str, any_pb2.Any]:
    return {Filter.LUA_ANSWERS: pack(lua_pb2.LuaPerRoute(disabled=True))}


def direct_clusters(snap: Snapshot) -> dict[str, tuple[str, ...]]:
    """The clusters of deployments the decision may translate for (extproc/direct.py), each with the
    headers its shape sets: their JSON and stream routes run the Lua answer filter."""
    return {snap.pool_of(d): shape_headers(d) for d in snap.deployments.values() if decision_translates(d)}


def answers_translated(snap: Snapshot) -> bool:
    """Whether any deployment's answers are translated or read (by the Lua answer filter, which is then
    rendered: a pool's JSON chat answers are checked to be one), or its token counts need the path and
    headers that filter sets."""
    return any(translated(d) or (bool(d.pool) and d.serves == "chat")
               or (can_count(d) and any(door.count_path for door in DOORS)) for d in snap.deployments.values())


def count_clusters(snap: Snapshot) -> dict[str, tuple[str, ...]]:
    """The clusters of deployments that count tokens for a door's token count, each with the headers
    its shape sets (kept from the route's removal list: the Lua answer filter sets them). A deployment
    without a credential (a pool) gets none set: the caller's own credential headers are removed."""
    return {snap.pool_of(d): shape_headers(d) if d.credential_ref else () for d in snap.deployments.values()
            if can_count(d)}


def translating_composites(snap: Snapshot, clusters: Iterable[str]) -> set[str]:
    """The composite clusters of routes with a candidate of another shape: the attempt filter names such
    a candidate's answer, and the Lua answer filter on their admitted routes translates it."""
    prefixes = tuple(composite_name(r.route_contract, ()) for r in snap.routes.values()
                     if any(translated(d) for c in r.candidates if (d := snap.deployments.get(c.deployment_name))))
    return {c for c in clusters if prefixes and c.startswith(prefixes)}


def route_config(snap: Snapshot, clusters: Iterable[str]) -> route_pb2.RouteConfiguration:
    stream_idle_ms = snap.gateway.envoy.stream_idle_timeout_ms
    # Envoy's own answers name the revision it was rendered from (ext_proc's name the one it decided
    # under, which a hot reload may have moved on).
    own = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", value="application/json")),
           base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=REVISION_HEADER, value=snap.revision))]
    ext_proc_by_headers = {Filter.EXT_PROC: pack(ext_proc_pb2.ExtProcPerRoute(
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
        # them; this is never reached. GET only: Gemini's `POST /v1/models/{route}:generateContent`
        # (google-genai with api_version v1) is a front door's request.
        route_components_pb2.Route(
            name="models", match=route_components_pb2.RouteMatch(
                path_separated_prefix=MODELS_PATH,
                headers=[GET_ONLY]),
            direct_response=direct(503, ErrorCode.POLICY_UNAVAILABLE, "the model list is unavailable"),
            response_headers_to_add=own, typed_per_filter_config=ext_proc_by_headers),
        # A door's own model paths (Gemini's GET /v1beta/models/{route}): the same, answered in its shape.
        *(route_components_pb2.Route(
            name=f"{door.name}_models", match=route_components_pb2.RouteMatch(
                safe_regex=regex_pb2.RegexMatcher(regex=door.models_path),
                headers=[GET_ONLY]),
            direct_response=direct(503, ErrorCode.POLICY_UNAVAILABLE, "the model list is unavailable", door),
            response_headers_to_add=own, typed_per_filter_config=ext_proc_by_headers)
          for door in DOORS if door.models_path),
    ]
    # Admitted requests: only ext_proc can set this metadata, so nothing else ever matches these. A
    # request ext_proc marked `settle: stream` (streams) or `settle: metered` (idempotent JSON) takes
    # the route where its response filter is on; every other admitted request settles through the
    # access log.
    def md(key: str, value: str) -> metadata_pb2.MetadataMatcher:
        return metadata_pb2.MetadataMatcher(filter=METADATA_NAMESPACE,
                                            path=[metadata_pb2.MetadataMatcher.PathSegment(key=key)],
                                            value=string_value_matcher(value))
    shadowed = shadowed_clusters(snap, clusters)
    composites_translating = translating_composites(snap, clusters)
    lua_answered = direct_clusters(snap)
    translated_here = dict.fromkeys((Settle.ACCESS_LOG, Settle.STREAM, Settle.CHECKED, Settle.CHECKED_STREAM),
                                    lua_answered)
    counting = count_clusters(snap)
    for cluster in clusters:
        if cluster in counting:
            # A door's token count admitted to this cluster: the Lua answer filter sets the count's path
            # and headers (extproc/direct.py count_request) and translates nothing; the door filter
            # reads the count. No path rewrite: the router would put it back over the filter's.
            count = metadata_pb2.MetadataMatcher(
                filter=METADATA_NAMESPACE, path=[metadata_pb2.MetadataMatcher.PathSegment(key=Key.COUNT)],
                value=matcher_pb2.ValueMatcher(present_match=True))
            routes.append(admitted_route(
                f"admitted_{cluster}_count", route_components_pb2.RouteMatch(prefix="/", dynamic_metadata=[
                    md(Key.CLUSTER, cluster), count]), cluster, False, stream_idle_ms,
                {**{k: v for k, v in _no_meter().items() if k != Filter.LUA_ANSWERS}, **_door_on()},
                shape_sets=counting[cluster]))
        for kind in (Settle.STREAM, Settle.KEPT_STREAM, Settle.CHECKED_STREAM, Settle.METERED, Settle.CHECKED,
                     Settle.ACCESS_LOG):
            # Idempotent (or checked) streams: ext_proc's stream guard. Idempotent (or checked) JSON: the
            # meter. Streams: the Lua stream guard only (it reads `settle` itself). Every JSON answer: the
            # Lua guard's script too, which names the route as its model. On a deployment the decision
            # translates for, JSON and streams also run the Lua answer filter. A checked answer's filter
            # fails closed: unchecked, it never reaches the client.
            no_meter: dict[str, any_pb2.Any] = {Filter.METER: pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))}
            off = pack(ext_proc_pb2.ExtProcPerRoute(disabled=True))
            json_answer = {Filter.STREAMS: off, **_no_lua_answers()}  # (the Lua guard's script stays on)
            per_route: dict[str, any_pb2.Any] = {
                Settle.STREAM: {**no_meter, Filter.STREAMS: off, **_no_lua_answers()},
                Settle.KEPT_STREAM: {**no_meter, **_no_lua_guard()},
                Settle.CHECKED_STREAM: {**no_meter, **_no_lua_guard(), Filter.STREAMS: _fail_closed()},
                Settle.METERED: json_answer,
                Settle.CHECKED: {**json_answer, Filter.METER: _fail_closed(whole_answer=True)},
                Settle.ACCESS_LOG: {**no_meter, **json_answer},
            }[kind]
            pool_json = kind is Settle.ACCESS_LOG and cluster.startswith(POOL_CLUSTER_PREFIX)
            if cluster in composites_translating or pool_json:
                # every answer of such a plan passes the Lua answer filter; so does a pool's JSON answer
                # (read as the OpenAI shape the decision names for it: a 2xx that is no answer is a 502)
                per_route = {k: v for k, v in per_route.items() if k != Filter.LUA_ANSWERS}
            streamed = kind in (Settle.STREAM, Settle.KEPT_STREAM, Settle.CHECKED_STREAM)
            name = f"admitted_{cluster}" + ("" if kind is Settle.ACCESS_LOG else f"_{kind}")
            metadata = [md(Key.CLUSTER, cluster), *([] if kind is Settle.ACCESS_LOG else [md(Key.SETTLE, kind)])]
            match = route_components_pb2.RouteMatch
            for door in DOORS:
                # Matched on the decision's `door` metadata, not on the path: no regular expression
                # is evaluated on the way to any route (every request walks these).
                routes.append(admitted_route(f"{name}_{door.name}", match(prefix="/", dynamic_metadata=[
                    *metadata, md(Key.DOOR, door.name)]), cluster, streamed, stream_idle_ms, per_route, door))
            if cluster in shadowed:  # the same, with a copy to the shadow candidate (extproc/shadow.py)
                present = metadata_pb2.MetadataMatcher(
                    filter=METADATA_NAMESPACE, path=[metadata_pb2.MetadataMatcher.PathSegment(key=Key.SHADOW)],
                    value=matcher_pb2.ValueMatcher(present_match=True))
                routes.append(admitted_route(f"{name}_shadow", match(prefix="/v1/", dynamic_metadata=[
                    *metadata, present]), cluster, streamed, stream_idle_ms, per_route, mirror=True))
            shape_sets: tuple[str, ...] = ()
            if cluster in translated_here.get(kind, {}):
                per_route = {k: v for k, v in per_route.items() if k != Filter.LUA_ANSWERS}
                shape_sets = translated_here[kind][cluster]
            routes.append(admitted_route(name, match(prefix="/v1/", dynamic_metadata=metadata),
                                         cluster, streamed, stream_idle_ms, per_route, shape_sets=shape_sets))
    routes += [
        # The routes a chat completion and an embeddings request match when they arrive, before
        # ext_proc decides: they turn the response filters on (their per-route switches on the
        # admitted route then decide). It is what such a request meets only when ext_proc never saw
        # it: one without a body.
        *(route_components_pb2.Route(
            name=name, match=route_components_pb2.RouteMatch(path=path),
            direct_response=direct(400, ErrorCode.INVALID_REQUEST, "a JSON request body is required"),
            response_headers_to_add=own, typed_per_filter_config=_response_filters_on(snap))
          for name, path in (("chat_without_body", CHAT_PATH), ("embeddings_without_body", EMBEDDINGS_PATH))),
        # A front door's request as it arrives (the door filter on, with the response filters); what
        # it meets only without a body.
        *(route_components_pb2.Route(
            name=f"{door.name}_without_body" + ("" if path == door.path else "_count"),
            match=route_components_pb2.RouteMatch(safe_regex=regex_pb2.RegexMatcher(regex=path)),
            direct_response=direct(400, ErrorCode.INVALID_REQUEST, "a JSON request body is required", door),
            response_headers_to_add=own, typed_per_filter_config={**_response_filters_on(snap), **_door_on()})
          for door in DOORS for path in door.paths),
        # Everything else, /v1/* included: no such endpoint. ext_proc takes its headers as a model
        # lookup's: it identifies the caller, answers with the endpoints the gateway serves, and
        # ledgers the refusal; this is never reached.
        route_components_pb2.Route(
            name="not_found", match=route_components_pb2.RouteMatch(prefix="/"),
            direct_response=direct(404, ErrorCode.ROUTE_NOT_FOUND, "no such endpoint"),
            response_headers_to_add=own, typed_per_filter_config=ext_proc_by_headers),
    ]
    return route_pb2.RouteConfiguration(name="llmgw", virtual_hosts=[route_components_pb2.VirtualHost(
        name="llmgw", domains=["*"], routes=routes, include_attempt_count_in_response=True,
        include_request_attempt_count=True)])


def shadowed_clusters(snap: Snapshot, clusters: Iterable[str]) -> set[str]:
    """The clusters a request of a route with a shadow can be admitted to: its candidates' own and its
    composites. Only these get the admitted route with the mirror policy (every request walks the
    route table, so it grows only where a shadow is configured)."""
    out: set[str] = set()
    for route in snap.routes.values():
        if route.shadow is None:
            continue
        out |= {snap.pool_of(snap.deployments[c.deployment_name]) for c in route.candidates
                if c.deployment_name in snap.deployments}
        out |= {c for c in clusters if c.startswith(composite_name(route.route_contract, ()))}
    return out


def mirror_policy() -> route_components_pb2.RouteAction.RequestMirrorPolicy:
    """The copy of an admitted request to the gateway's own listener: with its grant (only the copy
    carries it: an upstream never sees one) and a request id of its own (Envoy gives an external
    request a new one anyway; where loopback counts as internal it would keep the original's, and the
    copy's reservation and ledger entry would collide with it)."""
    hvo = base_pb2.HeaderValueOption
    return route_components_pb2.RouteAction.RequestMirrorPolicy(
        cluster=SHADOW_CLUSTER, disable_shadow_host_suffix_append=True,
        request_headers_mutations=[mutation_rules_pb2.HeaderMutation(append=hvo(
            header=base_pb2.HeaderValue(key=k, value=v), append_action=hvo.OVERWRITE_IF_EXISTS_OR_ADD)) for k, v in (
                (Header.SHADOW_GRANT, f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{Key.SHADOW_GRANT})%"),
                ("x-request-id", "%REQ(x-request-id)%-shadow"))])


def admitted_route(name: str, match: route_components_pb2.RouteMatch, cluster: str, streamed: bool,
                   stream_idle_ms: int, per_route: dict[str, any_pb2.Any],
                   door: Door | None = None, mirror: bool = False,
                   shape_sets: tuple[str, ...] = ()) -> route_components_pb2.Route:
    """A route only a decision reaches (its match holds ext_proc's metadata) to `cluster`; a front
    door's request was turned into a chat completion by ext_proc, so the upstream gets that path (the
    attempt filter sets a translated candidate's own, or the Lua answer filter, which sets the
    headers in `shape_sets`: the router must not remove them)."""
    rewrite = regex_pb2.RegexMatchAndSubstitute(pattern=regex_pb2.RegexMatcher(regex="^.*$"),
                                                substitution=CHAT_PATH) if door is not None else None
    return route_components_pb2.Route(
        name=name, match=match,
        route=route_components_pb2.RouteAction(
            # A JSON answer is silent until generated: its bound is the deadline. A stream's
            # silence is bounded per attempt (and an attempt silent before its first byte may
            # be retried or fall back, when ext_proc's retry policy says `reset`).
            # The route's own idle timer is a backstop above every attempt's: it is not reset when a
            # retry starts, so at the attempts' limit it could end a request whose silent first
            # attempt was about to fall back (found by `llmgw chaos`, slow first byte).
            cluster=cluster, timeout=duration_ms(0), regex_rewrite=rewrite,
            request_mirror_policies=[mirror_policy()] if mirror else [],
            idle_timeout=duration_ms(stream_idle_ms * (MAX_RETRIES + 1) if streamed else 300_000),
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
        request_headers_to_remove=[h for h in ("authorization", *CREDENTIAL_HEADERS) if h not in shape_sets],
        response_headers_to_remove=[] if cluster.startswith("fallback_") else [Header.DEPLOYMENT,
                                                                                Header.TRANSLATION_LOSS],
        typed_per_filter_config={**per_route,
                                 **(_door_on() if door is not None else {})})


def _fail_closed(whole_answer: bool = False) -> any_pb2.Any:
    """A response filter that checks an answer (Settle.CHECKED, CHECKED_STREAM): if ext_proc fails, the
    answer fails with it. A JSON answer is held whole with its headers (they wait for the body's reply),
    so a failing answer can still become the contract's 502."""
    pm = processing_mode_pb2.ProcessingMode
    mode = pm(request_header_mode=pm.SKIP, request_body_mode=pm.NONE, response_header_mode=pm.SEND,
              response_body_mode=pm.BUFFERED, request_trailer_mode=pm.SKIP,
              response_trailer_mode=pm.SKIP) if whole_answer else None
    return pack(ext_proc_pb2.ExtProcPerRoute(overrides=ext_proc_pb2.ExtProcOverrides(
        processing_mode=mode, failure_mode_allow=wrappers_pb2.BoolValue(value=False))))


def _door_on() -> dict[str, any_pb2.Any]:
    """The Lua door filter, off by default, on for a front door's path - where it arrives, and the
    admitted routes of its door, whichever route Envoy consults on the way out - running the door
    script, which reads the door the decision named."""
    return {Filter.LUA_DOORS: pack(route_components_pb2.FilterConfig(
        disabled=False, config=pack(lua_pb2.LuaPerRoute(name=DOORS_SCRIPT))))}


def _response_filters_on(snap: Snapshot) -> dict[str, any_pb2.Any]:
    """Turn on the response filters that are off by default (where a gateway renders them). Envoy
    refuses an empty per-route config, so each repeats a setting its filter already has."""
    # The Lua filters join the chain here, their scripts off on this route: each runs on the route
    # ext_proc's decision then selects where its script is not switched off (_no_lua_guard).
    lua_on = pack(route_components_pb2.FilterConfig(disabled=False, config=pack(lua_pb2.LuaPerRoute(disabled=True))))
    filters: dict[str, any_pb2.Any] = {Filter.LUA_ANSWERS: lua_on} if answers_translated(snap) else {}
    if meters(snap):
        on = pack(route_components_pb2.FilterConfig(disabled=False, config=pack(ext_proc_pb2.ExtProcPerRoute(
            overrides=ext_proc_pb2.ExtProcOverrides(failure_mode_allow=wrappers_pb2.BoolValue(value=True))))))
        filters |= {Filter.METER: on, Filter.STREAMS: on, Filter.LUA_STREAM_GUARD: lua_on}
    return filters
