"""Redaction and the logging policy. The decision's `redact` obligation names entity types; every
string the engine renders into the prompt (extproc/chat.py: message content, names, tool call ids and
arguments, reasoning, tool descriptions and parameter schemas) is rewritten with stable placeholders
before dispatch. A tool name is an identifier, not text: one that holds such a value is refused.
Content reaches a log (the `llmgw.content` logger) only when the route's `telemetry.record_content`
and the decision's `record_content` obligation both allow it, and then after redaction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from extproc.chat import map_rendered
from extproc.contract import ErrorCode, GatewayError
from extproc.exchange import Exchange
from extproc.redact import Redactor, known_entities

content_log = logging.getLogger("llmgw.content")


def _unchanged_name(redactor: Redactor) -> Callable[[str, str], str]:
    def check(name: str, param: str) -> str:
        if redactor.redact(name) != name:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "a tool name holds a value this request's data class "
                               "requires redacted; rename the tool", param)
        return name
    return check


class Redaction:
    name = "redact"

    async def run(self, ex: Exchange) -> None:
        decision = ex.decision
        if decision is None:
            return
        entities = known_entities(decision.redact)
        if entities:
            redactor = Redactor(entities)
            ex.body = map_rendered(ex.body, redactor.redact, _unchanged_name(redactor))
            ex.redactions = redactor.counts
        if decision.record_content and ex.route is not None and ex.route.telemetry.record_content:
            content_log.info(json.dumps({"request_id": ex.request_id, "route": ex.route.route_contract,
                                         "messages": ex.body["messages"], "tools": ex.body.get("tools")},
                                        ensure_ascii=False))
