"""Redaction: when the decision's obligations name entity types, replace them in every message's
text with stable placeholders before anything is sent upstream. Counts per type are recorded on the
Exchange; values never are.

Then the logging policy: content may be recorded only when the route's telemetry policy and the
decision both allow it, and only as redacted here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from extproc.exchange import Exchange
from extproc.redact import Redactor, known_entities

content_log = logging.getLogger("llmgw.content")


def redact_messages(messages: list[Any], redactor: Redactor) -> list[Any]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            m = {**m, "content": redactor.redact(content)}
        elif isinstance(content, list):
            m = {**m, "content": [{**p, "text": redactor.redact(p["text"])}
                                  if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                                  for p in content]}
        out.append(m)
    return out


class Redaction:
    name = "redact"

    async def run(self, ex: Exchange) -> None:
        decision = ex.decision
        if decision is None:
            return
        entities = known_entities(decision.redact)
        if entities:
            redactor = Redactor(entities)
            ex.body = {**ex.body, "messages": redact_messages(ex.body["messages"], redactor)}
            ex.redactions = redactor.counts
        if decision.record_content and ex.route is not None and ex.route.telemetry.record_content:
            content_log.info(json.dumps({"request_id": ex.request_id, "route": ex.route.route_contract,
                                         "messages": ex.body["messages"]}, ensure_ascii=False))
