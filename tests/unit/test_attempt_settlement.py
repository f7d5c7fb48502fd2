"""The pieces that settle every attempt (invariant 23): which requests may have an attempt that ran
without answering (the retry policy), the attempt log Envoy renders and what ext_proc reads of its
entries; the charge itself is tabled in test_accounting.py."""

from __future__ import annotations

import time

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2

from extproc.config import load_snapshot
from extproc.config.schema import Route
from extproc.names import Filter
from extproc.settlement.attempt_log import AttemptLog, attempt_end, is_attempt
from extproc.settlement.charge import AttemptEnd
from extproc.stages.retry import ambiguous_retries
from llmgw.bench.ablate import _hcm
from llmgw.render.bootstrap import RenderOptions, render_bootstrap
from tests.conftest import POLICY


def _route(**retry: object) -> Route:
    base = load_snapshot(POLICY).routes["chat-default"]
    return base.model_copy(update={"retry": base.retry.model_copy(update=retry)})


def test_only_a_retry_after_an_attempt_that_may_have_run_holds_more_than_one_bound() -> None:
    timeouts = _route(attempts=2, eligible_failures=("connect_before_send", "no_first_byte"))
    assert ambiguous_retries(timeouts, (), keyed=False) == 2
    # A request with effects is never retried after such an attempt, key or not.
    assert ambiguous_retries(timeouts, ("write",), keyed=True) == 0
    # Failures that prove nothing ran (no connection, an error status) hold one bound.
    assert ambiguous_retries(_route(attempts=2, eligible_failures=("connect_before_send", "unavailable")), (),
                             keyed=False) == 0
    assert ambiguous_retries(_route(attempts=2, eligible_failures=("no_first_byte",), requires="never"), (),
                             keyed=False) == 0


def _logs(boot: object) -> tuple[list[als_pb2.HttpGrpcAccessLogConfig], list[als_pb2.HttpGrpcAccessLogConfig]]:
    hcm = _hcm(boot)[1]
    router = router_pb2.Router()
    next(f for f in hcm.http_filters if f.name == Filter.ROUTER).typed_config.Unpack(router)

    def grpc(logs: object) -> list[als_pb2.HttpGrpcAccessLogConfig]:
        out = []
        for log in logs:  # type: ignore[attr-defined]
            if log.name == "envoy.access_loggers.http_grpc":
                config = als_pb2.HttpGrpcAccessLogConfig()
                log.typed_config.Unpack(config)
                out.append(config)
        return out
    return grpc(hcm.access_log), grpc(router.upstream_log)


def test_the_attempt_log_shares_the_settlement_logs_stream() -> None:
    """Envoy keeps one stream per worker thread for each gRPC log config: the same config puts a
    request's attempts on its own entry's stream, ahead of it, so the worker that settles it has them."""
    snap = load_snapshot(POLICY)
    settlement, attempts = _logs(render_bootstrap(snap, RenderOptions.from_snapshot(snap)))
    assert len(settlement) == 1 and len(attempts) == 1
    assert attempts[0].common_config == settlement[0].common_config
    assert {"x-request-id", "x-envoy-attempt-count"} <= set(attempts[0].additional_request_headers_to_log)


def _entry(n: str, status: int, sent: bool, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.common_properties.access_log_type = accesslog_pb2.AccessLogType.UpstreamEnd
    entry.request.request_headers["x-request-id"] = "rid-1"
    entry.request.request_headers["x-envoy-attempt-count"] = n
    if status:
        entry.response.response_code.value = status
    if sent:
        entry.common_properties.time_to_first_upstream_tx_byte.FromMilliseconds(1)
    for name, on in flags.items():
        setattr(entry.common_properties.response_flags, name, on)
    return entry


def test_an_attempt_entry_says_which_attempt_and_how_it_ended() -> None:
    timed_out = _entry("2", 0, True, upstream_request_timeout=True)
    assert is_attempt(timed_out)
    assert attempt_end(timed_out) == ("rid-1", AttemptEnd(2, 0, True, ("UT",)))
    assert attempt_end(_entry("1", 0, False, upstream_connection_failure=True)) == (
        "rid-1", AttemptEnd(1, 0, False, ("UF",)))
    assert attempt_end(_entry("1", 503, True)) == ("rid-1", AttemptEnd(1, 503, True))
    assert attempt_end(_entry("x", 0, True)) is None
    request_entry = accesslog_pb2.HTTPAccessLogEntry()
    request_entry.common_properties.access_log_type = accesslog_pb2.AccessLogType.DownstreamEnd
    assert not is_attempt(request_entry)


def test_attempts_wait_for_their_request_and_never_pile_up() -> None:
    log = AttemptLog(keep_s=60, most=2)
    log.add("a", AttemptEnd(1, 0, True))
    log.add("a", AttemptEnd(2, 503, True))
    assert set(log.take("a")) == {1, 2} and log.take("a") == {}
    for rid in ("b", "c", "d"):  # a request whose entry never comes here: the oldest go first
        log.add(rid, AttemptEnd(1, 0, True))
    assert len(log) == 2 and log.take("b") == {}
    old = AttemptLog(keep_s=0.005, most=10)
    old.add("e", AttemptEnd(1, 0, True))
    time.sleep(0.01)
    old.add("f", AttemptEnd(1, 0, True))  # kept past its time, "e" goes
    assert old.take("e") == {} and set(old.take("f")) == {1}
