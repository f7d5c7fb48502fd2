"""The attempts of a request that did not answer 2xx, from Envoy's attempt log (the router's upstream
log, llmgw/render/filters.py attempt_log): entries on the settlement log's own stream, before their
request's entry, so the worker that settles a request from the access log has them in memory. They are
kept by request id until that entry takes them (or for KEEP_S, if it never comes to this worker)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from extproc.names import ATTEMPT_COUNT_HEADER
from extproc.settlement.charge import AttemptEnd

KEEP_S = 120.0  # longer than any request's deadline and stream: its own entry has come by then
MOST = 20_000  # attempts kept at once, whatever comes: the oldest go first

UPSTREAM_END = accesslog_pb2.AccessLogType.UpstreamEnd
# Envoy's response flags an attempt can end with, as the access log's proto names them, and as its logs
# abbreviate them.
_FLAGS = {"upstream_connection_failure": "UF", "upstream_connection_termination": "UC",
          "upstream_remote_reset": "UR", "upstream_request_timeout": "UT", "upstream_overflow": "UO",
          "no_healthy_upstream": "UH", "upstream_protocol_error": "UPE", "local_reset": "LR",
          "upstream_max_stream_duration_reached": "UMSDR", "downstream_connection_termination": "DC"}


def is_attempt(entry: Any) -> bool:
    """Whether an access-log entry is one of the attempt log's (the end of one upstream request)."""
    return bool(entry.common_properties.access_log_type == UPSTREAM_END)


def attempt_end(entry: Any) -> tuple[str, AttemptEnd] | None:
    """An attempt-log entry decoded: its request's id and how the attempt ended."""
    headers = entry.request.request_headers
    rid = headers.get("x-request-id", "") or entry.request.request_id
    n = headers.get(ATTEMPT_COUNT_HEADER, "1")
    if not rid or not n.isdigit():
        return None
    common = entry.common_properties
    flags = common.response_flags
    return rid, AttemptEnd(int(n), entry.response.response_code.value,
                           common.HasField("time_to_first_upstream_tx_byte"),
                           tuple(abbr for name, abbr in _FLAGS.items() if getattr(flags, name)))


class AttemptLog:
    """Attempt ends by request id, until the request's settlement takes them."""

    def __init__(self, keep_s: float = KEEP_S, most: int = MOST):
        self.keep_s, self.most = keep_s, most
        self._ends: OrderedDict[str, tuple[float, dict[int, AttemptEnd]]] = OrderedDict()

    def add(self, rid: str, end: AttemptEnd) -> None:
        now = time.monotonic()
        _, ends = self._ends.get(rid) or (now, {})
        ends[end.n] = end
        self._ends[rid] = (now, ends)
        self._ends.move_to_end(rid)
        while self._ends and (len(self._ends) > self.most or now - next(iter(self._ends.values()))[0] > self.keep_s):
            self._ends.popitem(last=False)

    def take(self, rid: str) -> dict[int, AttemptEnd]:
        return self._ends.pop(rid, (0.0, {}))[1]

    def __len__(self) -> int:
        return len(self._ends)
