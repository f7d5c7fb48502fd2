"""Prometheus metrics: what an operator graphs and alerts on, with low-cardinality labels only (route,
deployment, provider, token type, termination, error code; never a tenant, a subject or content).

Names follow the OpenTelemetry GenAI semantic conventions as Prometheus writes them
(`gen_ai.server.request.duration` -> `gen_ai_server_request_duration_seconds`), with their advised
bucket boundaries, beside the gateway's own counters (`llmgw_*`). Each settled request is observed
exactly once: when its settlement is the one the store wrote (extproc/settlement/settler.py), so
a request settled twice (its filter, then the access log's backstop) is counted once, whichever
worker settled it.

Every ext_proc worker of a host writes into one directory (`PROMETHEUS_MULTIPROC_DIR`, set by
`llmgw up` and docker-compose; prometheus-client's multiprocess mode), and any worker's
`GET /metrics` (its status port) answers for all of them. Without the variable, a worker answers for
itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

if TYPE_CHECKING:
    from extproc.settlement.charge import Timing

# `LLMGW_METRICS=off`: nothing is observed (`llmgw bench telemetry` measures what observing costs).
ENABLED = os.environ.get("LLMGW_METRICS", "on") != "off"
if _shared := os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.makedirs(_shared, exist_ok=True)  # prometheus-client writes there from the first observation

# Advised bucket boundaries of the GenAI semantic conventions (seconds, tokens).
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
SERVED = ("route", "deployment", "provider")

REQUEST_DURATION = Histogram("gen_ai_server_request_duration", "Time from the request's arrival to its answer's end",
                             [*SERVED, "error_type"], unit="seconds", buckets=DURATION_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram("gen_ai_server_time_to_first_token",
                                "Time to a stream's first content token (text, a tool call or reasoning)",
                                SERVED, unit="seconds", buckets=TTFT_BUCKETS)
# The headers come before queueing and prefill: kept as its own figure, never as the time to first token.
TIME_TO_HEADERS = Histogram("llmgw_time_to_headers", "Time to a stream's response headers (its first byte)",
                            SERVED, unit="seconds", buckets=TTFT_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram("gen_ai_server_time_per_output_token",
                                  "A stream's time per output token after the first", SERVED, unit="seconds",
                                  buckets=TPOT_BUCKETS)
TOKEN_USAGE = Histogram("gen_ai_client_token_usage", "Tokens per request, by type (input, output)",
                        [*SERVED, "gen_ai_token_type"], buckets=TOKEN_BUCKETS)
SETTLEMENTS = Counter("llmgw_settlements", "Requests settled, by how they ended and how they were charged",
                      ["route", "deployment", "termination", "settlement"])
ATTEMPTS = Counter("llmgw_attempts", "Upstream attempts, by candidate, kind (first, retry, model_fallback) and "
                   "status class (2xx, 4xx, 5xx; 0: no answer)", ["deployment", "kind", "status"])
REFUSALS = Counter("llmgw_refusals", "Requests refused before any upstream, by the contract's error code",
                   ["route", "code"])
ADMITTED = Counter("llmgw_admitted", "Requests admitted: their budgets, quotas and bulkhead reserved", ["route"])
ADMISSIONS = Counter("llmgw_admission", "Admission decisions (extproc/admission.py) by pool or deployment, request "
                     "class and outcome: admitted, queued_admitted (after waiting), next_candidate (the plan's "
                     "first had no room), shed_queue_timeout, shed_queue_full (the worker's queue), shed_no_wait (no "
                     "queue TTL or deadline left), shed_quota (a provider quota: the deployment is the target)",
                     ["target", "request_class", "outcome"])
QUEUE_WAIT = Histogram("llmgw_admission_queue_duration", "Time a request waited for admission (admitted or shed)",
                       ["target", "request_class"], unit="seconds", buckets=DURATION_BUCKETS)
RELOADS = Counter("llmgw_config_reloads", "Configuration reloads by this host's workers (each worker reloads), "
                  "by result (accepted, refused: the last known good revision stays)", ["result"])
PICKS = Counter("llmgw_picker_decisions", "Engine picks per pool: by load, by a prefix the engine holds, or left to "
                "Envoy's balancer when no engine has fresh metrics", ["pool", "decision"])
STORE_LATENCY = Histogram("llmgw_store_duration", "Store round trips from the ext_proc workers (reserve, settle: "
                          "batches)", ["operation"], unit="seconds",
                          buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
STORE_UNREPLICATED = Counter("llmgw_store_unreplicated_batches", "Batches of store scripts whose WAIT saw fewer "
                             "replicas than store.replica_acks asks (the writes stand on the primary only)", [])
ANSWER_CHECK_FAILURES = Counter("llmgw_answer_check_failures", "Checks answers failed (extproc/answer_checks.py), "
                                "by route, check and whether the answer was refused (enforce) or passed "
                                "(report)", ["route", "check", "action"])
FINISH_REASONS = Counter("llmgw_finish_reasons", "Answers whose finish reason a filter read (streams, pool and "
                         "translated JSON answers, checked and idempotent ones), by route and finish reason "
                         "(stop, length, tool_calls, content_filter; other)", ["route", "finish_reason"])
FINISH_REASON_VALUES = frozenset({"stop", "length", "tool_calls", "content_filter"})
# Per tenant, only where gateway.yaml says so (`metrics.tenant_label: true`): a label per tenant is
# unbounded in a multi-tenant deployment, so the default families carry none.
TENANT_SETTLEMENTS = Counter("llmgw_tenant_settlements", "Requests settled per tenant (metrics.tenant_label)",
                             ["tenant", "route", "termination"])
TENANT_TOKENS = Counter("llmgw_tenant_tokens", "Tokens charged per tenant (metrics.tenant_label)",
                        ["tenant", "gen_ai_token_type"])


def _series(metric: Counter | Histogram, labels: tuple[str, ...]) -> Any:
    """The metric's child for these label values, looked up once: `labels()` validates and locks on
    every call, several times a request otherwise (label values are few: route, deployment, code...)."""
    return _child(metric, labels)


_child = functools.lru_cache(maxsize=8192)(lambda metric, labels: metric.labels(*labels))


def observe_settlement(route: str, deployment: str, provider: str, stream: bool, status: int,
                       outcome: Mapping[str, Any], timing: Timing) -> None:
    """One settled request (the settlement the store wrote)."""
    if not ENABLED:
        return
    served = (route or "unknown", deployment or "none", provider or "none")
    termination = str(outcome.get("termination", ""))
    _series(SETTLEMENTS, (served[0], served[1], termination, str(outcome.get("settlement", "")))).inc()
    ok = 200 <= status < 300 and termination == "complete"
    duration_s, first_token_s = timing.duration_s, timing.first_token_s
    if duration_s is not None:
        _series(REQUEST_DURATION, (*served, "" if ok else termination or str(status))).observe(duration_s)
    usage = outcome.get("usage") or {}
    output = int(usage.get("completion_tokens") or 0)
    if usage:
        _series(TOKEN_USAGE, (*served, "input")).observe(int(usage.get("prompt_tokens") or 0))
        _series(TOKEN_USAGE, (*served, "output")).observe(output)
    checks = outcome.get("answer_checks")
    if isinstance(checks, dict):
        action = "refused" if checks.get("rejected") else "passed"
        for f in checks.get("failed") or ():
            _series(ANSWER_CHECK_FAILURES, (served[0], str(f.get("check", "")), action)).inc()
    for attempt in (outcome.get("attempts") or [])[-1:]:
        finish = attempt.get("finish_reason") if isinstance(attempt, dict) else None
        for reason in finish if isinstance(finish, list) else ([finish] if finish else []):
            _series(FINISH_REASONS, (served[0], reason if reason in FINISH_REASON_VALUES else "other")).inc()
    if stream and ok and timing.first_byte_s is not None:
        _series(TIME_TO_HEADERS, served).observe(timing.first_byte_s)
    if stream and ok and first_token_s is not None:
        _series(TIME_TO_FIRST_TOKEN, served).observe(first_token_s)
        if duration_s is not None and output > 1:
            _series(TIME_PER_OUTPUT_TOKEN, served).observe(max(duration_s - first_token_s, 0.0) / (output - 1))


def observe_tenant(tenant: str, route: str, outcome: Mapping[str, Any]) -> None:
    """The per-tenant families (only called where gateway.yaml's metrics.tenant_label is on)."""
    if not ENABLED:
        return
    _series(TENANT_SETTLEMENTS, (tenant, route or "unknown", str(outcome.get("termination", "")))).inc()
    usage = outcome.get("usage") or {}
    for kind, field in (("input", "prompt_tokens"), ("output", "completion_tokens")):
        if usage.get(field):
            _series(TENANT_TOKENS, (tenant, kind)).inc(int(usage[field]))


def count_admitted(route: str) -> None:
    if ENABLED:
        _series(ADMITTED, (route,)).inc()


def count_admission(target: str, request_class: str, outcome: str, waited_s: float | None = None) -> None:
    if not ENABLED:
        return
    _series(ADMISSIONS, (target, request_class, outcome)).inc()
    if waited_s is not None:
        _series(QUEUE_WAIT, (target, request_class)).observe(waited_s)


def count_reload(accepted: bool) -> None:
    if ENABLED:
        _series(RELOADS, ("accepted" if accepted else "refused",)).inc()


def count_pick(pool: str, decision: str) -> None:
    if ENABLED:
        _series(PICKS, (pool, decision)).inc()


def observe_store(operation: str, seconds: float) -> None:
    if ENABLED:
        _series(STORE_LATENCY, (operation,)).observe(seconds)


def count_unreplicated() -> None:
    if ENABLED:
        STORE_UNREPLICATED.inc()


def count_attempt(deployment: str, kind: str, status: int) -> None:
    if not ENABLED:
        return
    _series(ATTEMPTS, (deployment or "none", kind, f"{status // 100}xx" if status else "0")).inc()


def count_refusal(route: str, code: str) -> None:
    if not ENABLED:
        return
    _series(REFUSALS, (route or "unknown", code)).inc()


def exposition() -> tuple[bytes, str]:
    """The Prometheus text of this host's workers (all of them, in multiprocess mode)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
