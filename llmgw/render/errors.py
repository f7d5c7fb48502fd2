"""Errors Envoy answers itself, in the contract's JSON: its local replies, upstream error statuses
(custom_response), direct responses."""

from __future__ import annotations

import json
from collections.abc import Mapping

from envoy.config.core.v3 import base_pb2, substitution_format_string_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.custom_response.v3 import custom_response_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.http.custom_response.local_response_policy.v3 import local_response_policy_pb2
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2
from envoy.extensions.matching.input_matchers.metadata.v3 import metadata_pb2 as input_metadata_pb2
from envoy.type.matcher.v3 import http_inputs_pb2, status_code_input_pb2, string_pb2
from envoy.type.matcher.v3 import value_pb2 as struct_value_matcher_pb2
from google.protobuf import wrappers_pb2
from xds.core.v3 import extension_pb2 as xds_extension_pb2
from xds.type.matcher.v3 import matcher_pb2
from xds.type.matcher.v3 import regex_pb2 as xds_regex_pb2
from xds.type.matcher.v3 import string_pb2 as xds_string_pb2

from extproc.contract import METADATA_NAMESPACE, REVISION_HEADER, ErrorCode, GatewayError, degraded_body, retry_advice
from extproc.names import EXTPROC_FAILED, MD, Header, Key, Settle
from extproc.shapes.registry import DOORS, Door
from llmgw.render.common import cel_filter, pack
from llmgw.render.filters import upstream_answer_headers

Predicate = matcher_pb2.Matcher.MatcherList.Predicate
OWN_REPLY_PREFIX = "llmgw"  # details of ext_proc's own ImmediateResponses start with this


def _contract_json(code: ErrorCode, message: str, status: int = 0, door: Door | None = None) -> (
        substitution_format_string_pb2.SubstitutionFormatString):
    """The contract's error body as an Envoy JSON format string; for a front door's caller, in its
    shape, written where the reply is made (the Lua door filter keeps a body already in its shape)."""
    body = GatewayError(code, message).body()
    if door is not None:
        body = door.error(status, body)
    # As text, not `json_format`: a Struct holds numbers as doubles, and Envoy wrote Google's integer
    # `code` as "502.0". The body has no command operators, so each % is escaped.
    text = json.dumps(json.loads(body), separators=(",", ":"), ensure_ascii=False)
    return substitution_format_string_pb2.SubstitutionFormatString(
        text_format_source=base_pb2.DataSource(inline_string=text.replace("%", "%%")),
        content_type="application/json")




def door_expr(door: Door) -> str:
    """CEL: this request came through `door`. Once decided, the decision's `door` metadata says so: the
    path no longer can, since a translated candidate's path is the provider's (the Lua answer filter
    set /v1/messages on a chat completion for an Anthropic-shaped one). Undecided (ext_proc failed, the
    body was too large), the path as the client sent it (Envoy keeps it in x-envoy-original-path when
    a route rewrote it)."""
    decided = f"'{METADATA_NAMESPACE}' in metadata.filter_metadata && '{Key.REQUEST_ID}' in {MD}"
    named = f"'{Key.DOOR}' in {MD} && {MD}['{Key.DOOR}'] == '{door.name}'"
    path = "('x-envoy-original-path' in request.headers ? request.headers['x-envoy-original-path'] : request.path)"
    matches = " || ".join(f"{path}.matches('^{p}([?].*)?$')" for p in door.paths)
    return f"(({decided}) ? ({named}) : ({matches}))"


# Envoy's own local replies -> contract errors. ext_proc's ImmediateResponses (details `llmgw*`) and
# direct responses (already contract JSON) pass untouched.
# custom_response's replies carry empty details.
_NOT_OURS = (f"!response.code_details.startsWith('{OWN_REPLY_PREFIX}') && "
             "response.code_details != 'direct_response' && response.code_details != ''")


# Envoy's answer when no ext_proc worker took the request: nothing about it was decided or recorded.
NOT_PROCESSED = "the gateway's policy service is unavailable; the request was not processed"
LOCAL_REPLY_RULES: tuple[tuple[str, int, ErrorCode, str], ...] = (
    (f"response.code_details.startsWith('{EXTPROC_FAILED}')", 503, ErrorCode.POLICY_UNAVAILABLE, NOT_PROCESSED),
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


# Every upstream of the plan was down: none had a healthy host, or none took the connection.
ALL_DOWN = "(response.code_details == 'no_healthy_upstream' || response.code_details.contains('connection_failure'))"
_RID, _CREATED = "@@llmgw-request-id@@", 1  # placeholders in the rendered body, replaced by formatters


def _degraded_mappers(degraded: Mapping[str, str], revision_header: base_pb2.HeaderValueOption) -> (
        list[hcm_pb2.ResponseMapper]):
    """A route's fixed degraded answer when every upstream was down at dispatch (the decision, which
    cannot see Envoy's health, had admitted it): 200 with the answer instead of 502. Chat completions
    only (a front door's caller keeps its 502, in its shape) and not for an idempotent answer, whose
    meter would record it for replay. Settlement charges it nothing (extproc/settlement/)."""
    settle = f"('{Key.SETTLE}' in {MD} ? {MD}['{Key.SETTLE}'] == '{{}}' : true)"
    kinds = ((False, f"!('{Key.STREAM}' in {MD}) && " + settle.format(Settle.ACCESS_LOG), "application/json"),
             (True, f"('{Key.STREAM}' in {MD}) && " + settle.format(Settle.STREAM), "text/event-stream"))
    out = []
    for route, text in sorted(degraded.items()):
        for stream, which, content_type in kinds:
            body = degraded_body(route, text, _RID, _CREATED, stream, usage_chunk=False).decode()
            body = (body.replace("%", "%%").replace(_RID, "%REQ(x-request-id)%")
                    .replace(f'"created":{_CREATED}', '"created":%START_TIME(%s)%'))
            out.append(hcm_pb2.ResponseMapper(
                filter=cel_filter(f"{_NOT_OURS} && response.code >= 500 && {ALL_DOWN} && "
                                   f"{MD}['{Key.ROUTE}'] == {json.dumps(route)} && !('{Key.DOOR}' in {MD}) && {which}"),
                status_code=wrappers_pb2.UInt32Value(value=200),
                body_format_override=substitution_format_string_pb2.SubstitutionFormatString(
                    text_format_source=base_pb2.DataSource(inline_string=body), content_type=content_type),
                headers_to_add=[revision_header, base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=Header.DEGRADED, value="response"),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]))
    return out


def _advice(code: ErrorCode) -> list[base_pb2.HeaderValueOption]:
    """The contract's retry advice for an error of `code` (extproc/contract.py retry_advice), as headers."""
    return [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, value=v),
                                       append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in retry_advice(code).items()]


def local_reply_config(revision: str, degraded: Mapping[str, str] | None = None) -> hcm_pb2.LocalReplyConfig:
    """Envoy's own replies in the contract's shape, naming the revision Envoy was rendered from (and
    first, each route's fixed degraded answer for when its upstreams were all down). The
    response filters that could hold such a reply are off unless a chat route turned them on, so a
    reply to a request Envoy could not even parse is complete (a filter waiting for ext_proc once
    left it without its body when Envoy closed the connection)."""
    revision_header = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=REVISION_HEADER, value=revision),
                                                 append_action=base_pb2.HeaderValueOption.ADD_IF_ABSENT)
    return hcm_pb2.LocalReplyConfig(mappers=[
        *_degraded_mappers(degraded or {}, revision_header),
        *(hcm_pb2.ResponseMapper(
            filter=cel_filter(f"{door_expr(door)} && {expr}" if door is not None else expr),
            status_code=wrappers_pb2.UInt32Value(value=status),
            body_format_override=_contract_json(code, message, status, door),
            headers_to_add=[revision_header, *_advice(code)],
        )
          for door in (*DOORS, None)  # a door's callers first, in their shape
          for expr, status, code, message in LOCAL_REPLY_RULES),
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


# The upstream refused the request itself (invalid, too large): its reason is the caller's to read. The
# filter nearest the router writes it into the contract's error (extproc/lua/upstream_status.lua) and
# says so in the metadata; custom_response answers these statuses only where it did not.
REFUSAL_STATUSES = frozenset(upstream for upstream, _, code, _ in UPSTREAM_ERROR_RULES
                             if code is ErrorCode.INVALID_REQUEST)
_REASON = "@@llmgw-upstream-reason@@"  # where the reason goes in the rendered body


def upstream_refusals() -> dict[int, tuple[int, str, str]]:
    """Each refusal status -> the status the caller gets and the contract's error body around the
    upstream's reason (its JSON-escaped text goes between the two)."""
    out = {}
    for upstream, status, code, message in UPSTREAM_ERROR_RULES:
        if upstream in REFUSAL_STATUSES:
            before, after = GatewayError(code, f"{message}: {_REASON}").body().decode().split(_REASON)
            out[upstream] = (status, before, after)
    return out


# What an upstream's 2xx answer may be: JSON, an SSE stream, or Bedrock's event stream (the Lua answer
# filter translates the last two). Anything else - a proxy's HTML page - is not an answer at all. (A
# safe_regex must match the whole value.)
ANSWER_CONTENT_TYPES = r"(?i)\s*(application/json|text/event-stream|application/vnd\.amazon\.eventstream)\s*(;.*)?"
NOT_AN_ANSWER = (502, ErrorCode.UPSTREAM_ERROR, "the upstream's answer is not a chat completion (its content type)")


def _policy(name: str, status: int, code: ErrorCode, message: str, door: Door | None) -> matcher_pb2.Matcher.OnMatch:
    return matcher_pb2.Matcher.OnMatch(action=xds_extension_pb2.TypedExtensionConfig(
        name=name, typed_config=pack(local_response_policy_pb2.LocalResponsePolicy(
            status_code=wrappers_pb2.UInt32Value(value=status),
            body_format=_contract_json(code, message, status, door),
            # Its content_type is ignored in 1.40; the header is set here instead.
            response_headers_to_add=[*upstream_answer_headers(errors=True), *_advice(code), base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)],
        ))))


def _not_an_answer(door: Door | None) -> matcher_pb2.Matcher.OnMatch:
    """A 200 whose content type no answer has: the contract's 502 (settled as the work the upstream may
    have done: its status was a 2xx, issue 31). Decided on the headers, so no answer pays for a body check."""
    content_type = xds_extension_pb2.TypedExtensionConfig(name="content_type", typed_config=pack(
        http_inputs_pb2.HttpResponseHeaderMatchInput(header_name="content-type")))
    answer_like = Predicate(single_predicate=Predicate.SinglePredicate(
        input=content_type, value_match=xds_string_pb2.StringMatcher(safe_regex=xds_regex_pb2.RegexMatcher(
            google_re2=xds_regex_pb2.RegexMatcher.GoogleRE2(), regex=ANSWER_CONTENT_TYPES))))
    return matcher_pb2.Matcher.OnMatch(matcher=matcher_pb2.Matcher(matcher_list=matcher_pb2.Matcher.MatcherList(
        matchers=[matcher_pb2.Matcher.MatcherList.FieldMatcher(
            predicate=Predicate(not_matcher=answer_like), on_match=_policy("not_an_answer", *NOT_AN_ANSWER, door))])))


def _unless_reasoned(policy: matcher_pb2.Matcher.OnMatch) -> matcher_pb2.Matcher.OnMatch:
    """`policy`, unless the upstream's refusal already reached the contract with its reason."""
    return matcher_pb2.Matcher.OnMatch(matcher=matcher_pb2.Matcher(matcher_list=matcher_pb2.Matcher.MatcherList(
        matchers=[matcher_pb2.Matcher.MatcherList.FieldMatcher(
            predicate=Predicate(not_matcher=_metadata_is(Key.UPSTREAM_MESSAGE, None)), on_match=policy)])))


def _upstream_rule(upstream: int, status: int, code: ErrorCode, message: str,
                   door: Door | None) -> matcher_pb2.Matcher.OnMatch:
    policy = _policy(f"upstream_{upstream}", status, code, message, door)
    return _unless_reasoned(policy) if upstream in REFUSAL_STATUSES else policy


def _status_rules(door: Door | None) -> matcher_pb2.Matcher:
    """Upstream error statuses -> contract errors, in the caller's shape (a front door's, or the
    contract's own); a 200 that is no answer -> the contract's 502."""
    status_input = xds_extension_pb2.TypedExtensionConfig(
        name="status", typed_config=pack(status_code_input_pb2.HttpResponseStatusCodeMatchInput()))
    return matcher_pb2.Matcher(matcher_tree=matcher_pb2.Matcher.MatcherTree(
        input=status_input,
        exact_match_map=matcher_pb2.Matcher.MatcherTree.MatchMap(map={
            **{str(upstream): _upstream_rule(upstream, status, code, message, door)
               for upstream, status, code, message in UPSTREAM_ERROR_RULES},
            "200": _not_an_answer(door)})))



def _metadata_is(key: Key, value: str | None) -> matcher_pb2.Matcher.MatcherList.Predicate:
    """The decision's `key` metadata equals `value` (or, for None, is present)."""
    want = (struct_value_matcher_pb2.ValueMatcher(present_match=True) if value is None
            else struct_value_matcher_pb2.ValueMatcher(string_match=string_pb2.StringMatcher(exact=value)))
    return Predicate(single_predicate=Predicate.SinglePredicate(
        input=xds_extension_pb2.TypedExtensionConfig(name=f"metadata_{key}", typed_config=pack(
            network_inputs_pb2.DynamicMetadataInput(
                filter=METADATA_NAMESPACE, path=[network_inputs_pb2.DynamicMetadataInput.PathSegment(key=key)]))),
        custom_match=xds_extension_pb2.TypedExtensionConfig(name="metadata", typed_config=pack(
            input_metadata_pb2.Metadata(value=want)))))


def upstream_errors_filter() -> custom_response_pb2.CustomResponse:
    """Upstream error statuses are rewritten only for a request ext_proc admitted (it named the
    cluster), so Envoy's direct responses and ext_proc's own replies stay as sent; a front door's
    caller gets them in its door's shape. The rules are written once, at the filter: as per-route
    configuration (each admitted route its shape's table) they were three quarters of the whole
    Envoy configuration, 10 KB on each of about a hundred routes."""
    # (An attempt the attempt filter refused itself carries the contract's error already.)
    admitted = Predicate(and_matcher=Predicate.PredicateList(predicate=[
        _metadata_is(Key.CLUSTER, None), Predicate(not_matcher=_metadata_is(Key.ATTEMPT_REFUSED, None))]))
    doors = [matcher_pb2.Matcher.MatcherList.FieldMatcher(
        predicate=Predicate(and_matcher=Predicate.PredicateList(
            predicate=[admitted, _metadata_is(Key.DOOR, door.name)])),
        on_match=matcher_pb2.Matcher.OnMatch(matcher=_status_rules(door))) for door in DOORS]
    contract = matcher_pb2.Matcher.MatcherList.FieldMatcher(
        predicate=admitted, on_match=matcher_pb2.Matcher.OnMatch(matcher=_status_rules(None)))
    return custom_response_pb2.CustomResponse(custom_response_matcher=matcher_pb2.Matcher(
        matcher_list=matcher_pb2.Matcher.MatcherList(matchers=[*doors, contract])))


def direct(status: int, code: ErrorCode, message: str,
           door: Door | None = None) -> route_components_pb2.DirectResponseAction:
    """A contract error Envoy answers itself; on a front door's path, in its caller's shape."""
    body = json.dumps({"error": {"message": message, "type": code.error_type, "code": code.value,
                                 "param": None}})
    if door is not None:
        body = door.error(status, body.encode()).decode()
    return route_components_pb2.DirectResponseAction(status=status, body=base_pb2.DataSource(inline_string=body))
