"""Every error says whether a client's retry can change it (extproc/contract.py retry_advice): the
refusals capacity or the gateway's own dependencies decide say when to come back; every other error is
final, whoever wrote it - ext_proc, Envoy's own replies, the upstream-error rewrites."""

from __future__ import annotations

import json
import re

import pytest

from extproc.contract import RETRY_LATER_S, SHOULD_RETRY_HEADER, ErrorCode, GatewayError, retry_advice
from llmgw.render.errors import local_reply_config, upstream_errors_filter

LATER = {ErrorCode.RATE_LIMITED, ErrorCode.CONCURRENCY_LIMITED, ErrorCode.OVERLOADED, ErrorCode.POLICY_UNAVAILABLE}


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_code_says_whether_to_retry(code: ErrorCode) -> None:
    advice = retry_advice(code)
    if code in LATER:
        assert advice == {"retry-after": str(RETRY_LATER_S[code]), SHOULD_RETRY_HEADER: "true"}
    else:
        assert advice == {SHOULD_RETRY_HEADER: "false"}


def test_a_refusal_that_names_a_time_may_retry_whatever_its_code() -> None:
    in_flight = GatewayError(ErrorCode.IDEMPOTENCY_CONFLICT, "in flight", headers={"retry-after": "1"})
    assert in_flight.response_headers() == {"retry-after": "1", SHOULD_RETRY_HEADER: "true"}
    spent = GatewayError(ErrorCode.OVERLOADED, "quota spent", headers={"retry-after": "7"})
    assert spent.response_headers()["retry-after"] == "7"  # its own time, not the default
    assert GatewayError(ErrorCode.BUDGET_EXHAUSTED, "spent").response_headers() == {SHOULD_RETRY_HEADER: "false"}


def test_envoys_own_errors_and_the_upstream_rewrites_carry_the_advice() -> None:
    def advice(headers: list) -> dict[str, str]:  # type: ignore[type-arg]
        return {h.header.key: h.header.value for h in headers if h.header.key in (SHOULD_RETRY_HEADER, "retry-after")}

    def code_of(body: str) -> str:
        found = re.search(r'"code":\s*"([a-z_]+)"', body) or re.search(r'"reason":\s*"([a-z_]+)"', body)
        return found.group(1) if found else ""

    by_code: dict[str, list[dict[str, str]]] = {}
    for m in local_reply_config("rev").mappers:
        by_code.setdefault(code_of(m.body_format_override.text_format_source.inline_string), []).append(
            advice(list(m.headers_to_add)))
    assert by_code["policy_unavailable"] and all(
        a == {"retry-after": "1", SHOULD_RETRY_HEADER: "true"} for a in by_code["policy_unavailable"])
    for code in ("upstream_error", "deadline_exceeded", "invalid_request", "route_not_found"):
        assert by_code[code] and all(a == {SHOULD_RETRY_HEADER: "false"} for a in by_code[code]), code
    # The upstream-error rewrites (custom_response's policies, as Envoy reads them from the bootstrap).
    from google.protobuf import json_format

    from llmgw.render.common import pack

    rendered = json.dumps(json_format.MessageToDict(pack(upstream_errors_filter())))
    policies = re.findall(r'"responseHeadersToAdd": (\[.*?\])', rendered)
    assert len(policies) > 10
    for headers in policies:
        assert {"header": {"key": SHOULD_RETRY_HEADER, "value": "false"},
                "appendAction": "OVERWRITE_IF_EXISTS_OR_ADD"} in json.loads(headers), headers
