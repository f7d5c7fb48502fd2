"""Metrics (issue 14, parts 2 and 3): every ext_proc worker of a host writes one set of metrics, any
worker's GET /metrics answers for all of them, each settled request is counted exactly once, and a
real Prometheus (Debian's `prometheus`) scrapes it and answers a PromQL query for TTFT p95 per
route."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from extproc.store import ledger_entry, ledger_key
from llmgw.local.procs import free_port
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.helpers import request

pytestmark = pytest.mark.e2e
STREAMS, ANSWERS = 3, 3


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("metrics"), workers=2)
    auth = {"authorization": f"Bearer {DEMO_KEYS['acme']}"}
    for i in range(STREAMS + ANSWERS):
        # The last answer is idempotent: the meter settles it (its ext_proc filter, not the access log).
        key = {"idempotency-key": "metrics-idempotent-a"} if i == STREAMS + ANSWERS - 1 else {}
        r = request(f"{s.url}/v1/chat/completions", "POST", {
            "model": "chat-default", "max_tokens": 6, "stream": i < STREAMS,
            "messages": [{"role": "user", "content": f"measure me {'abcdef'[i]}"}]}, {**auth, **key})
        assert r.status == 200, r.body
        ledger_of(s, r.headers["x-request-id"], "acme")  # settled
    refused = request(f"{s.url}/v1/chat/completions", "POST", {
        "model": "chat-default", "bogus": 1, "messages": [{"role": "user", "content": "x"}]}, auth)
    assert refused.status == 400
    yield s
    s.stop()


def families(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> (sorted labels) -> value, for every sample."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(request(url).body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[tuple[tuple[str, str], ...], float], **match: str) -> float:
    return sum(v for labels, v in samples.items() if all(dict(labels).get(k) == w for k, w in match.items()))


def test_every_worker_answers_for_all_and_each_request_counts_once(gw: Stack) -> None:
    one = families(gw.metrics_url)
    other = families(gw.status_urls[1].replace("/status", "/metrics"))
    assert one == other  # either worker's endpoint: the host's metrics
    settled = one["llmgw_settlements_total"]
    assert total(settled, route="chat-default", termination="complete") == STREAMS + ANSWERS
    ttft = one["gen_ai_server_time_to_first_token_seconds_count"]
    assert total(ttft, route="chat-default", deployment="pool-llama-8b", provider="self-hosted") == STREAMS
    tokens = one["gen_ai_client_token_usage_count"]
    assert total(tokens, gen_ai_token_type="input") == total(tokens, gen_ai_token_type="output") == STREAMS + ANSWERS
    assert total(one["gen_ai_client_token_usage_sum"], gen_ai_token_type="output") == 6 * (STREAMS + ANSWERS)
    assert total(one["llmgw_refusals_total"], code="unsupported_field") == 1
    durations = one["gen_ai_server_request_duration_seconds_count"]
    assert total(durations, route="chat-default", error_type="") == STREAMS + ANSWERS
    # No tenant, subject or content in any label.
    labels = {k for fam in one.values() for key in fam for k, _ in key}
    assert not labels & {"tenant", "subject", "user"}


def test_admissions_picks_store_round_trips_and_what_the_store_holds(gw: Stack) -> None:
    deadline = time.monotonic() + 5  # the workers' slices end a second after they were taken
    while (one := families(gw.metrics_url))["llmgw_reservations_open"][()] and time.monotonic() < deadline:
        time.sleep(0.2)
    admitted = STREAMS + ANSWERS  # the refused request reserved nothing
    assert total(one["llmgw_admitted_total"], route="chat-default") == admitted
    # One pick per request routed to the pool (by load, by prefix, or Envoy's when metrics are stale).
    assert total(one["llmgw_picker_decisions_total"], pool="engine-pool") == admitted
    # Admitted from the workers' slices: a store round trip per slice, not per request (record 0033);
    # their admissions written behind, and the settlements, in batches. The idempotent answer reserved
    # on its own (the store's answer decides a replay before it runs).
    rounds = one["llmgw_store_duration_seconds_count"]
    assert total(rounds, operation="reserve") == 1
    assert 1 <= total(rounds, operation="take_slice") <= 4 < admitted  # per worker, streams and answers apart
    assert total(rounds, operation="commit_slices") >= 1
    assert total(rounds, operation="settle_batch") >= 1
    # Read from the store at scrape time: nothing in flight now, and the budget's remainder is its
    # limit less exactly what the ledger charged.
    assert one["llmgw_store_up"][()] == 1
    assert one["llmgw_reservations_open"][()] == 0 and one["llmgw_inflight_tokens"][()] == 0
    charged = sum(ledger_entry(f)["charged_micros"] for _, f in redis.Redis.from_url(
        str(gw.store_url), decode_responses=True).xrange(ledger_key("acme")))
    assert charged > 0
    assert one["llmgw_budget_reserved"][(("budget", "acme-monthly"), ("unit", "micros"))] == 0
    assert one["llmgw_budget_remaining"][(("budget", "acme-monthly"), ("unit", "micros"))] == 100_000_000 - charged
    assert not any(name.startswith("llmgw_tenant_") for name in one)  # per-tenant families: off by default


def _prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package (.ci/run installs it)"
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "llmgw", "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}]}))
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"))  # noqa: SIM115
    return proc, f"http://127.0.0.1:{port}"


def query(url: str, promql: str) -> list[dict[str, object]]:
    """The query's result; [] while Prometheus is not up or has no data. An invalid query fails."""
    try:
        r = request(f"{url}/api/v1/query?query={urllib.parse.quote(promql)}")
    except OSError:
        return []
    assert r.status != 400, f"{promql}: {r.body.decode()}"  # a bad query is the query's fault
    if r.status != 200:
        return []
    result: list[dict[str, object]] = r.json()["data"]["result"]
    return result


def wait_for(url: str, promql: str, timeout: float = 30) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while not (result := query(url, promql)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return result


@pytest.fixture(scope="module")
def prometheus(gw: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("prometheus")
    proc, url = _prometheus(tmp, gw.metrics_url.removeprefix("http://").removesuffix("/metrics"))
    up = wait_for(url, 'up{job="llmgw"} == 1')
    assert up, (tmp / "prometheus.log").read_text()[-2000:]
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_a_real_prometheus_scrapes_it_and_answers_ttft_p95_per_route(gw: Stack, prometheus: str) -> None:
    p95 = "histogram_quantile(0.95, sum by (le, route) (gen_ai_server_time_to_first_token_seconds_bucket))"
    (series,) = wait_for(prometheus, p95)
    assert series["metric"] == {"route": "chat-default"}  # type: ignore[comparison-overlap]
    value = float(series["value"][1])  # type: ignore[index]
    assert 0 < value <= 10.0  # seconds, within the advised buckets
    (settled,) = wait_for(prometheus, 'sum(llmgw_settlements_total{route="chat-default"})')
    assert float(settled["value"][1]) >= STREAMS + ANSWERS  # type: ignore[index]


def test_the_dashboards_queries_are_valid_and_its_latency_panels_show_data(gw: Stack, prometheus: str) -> None:
    """deploy/grafana/dashboards/llmgw.json, each panel's query run by the real Prometheus (Grafana's
    `$__rate_interval` as 1m) while traffic flows."""
    auth = {"authorization": f"Bearer {DEMO_KEYS['acme']}"}
    for i in range(4):  # traffic between scrapes: rates over the window are not zero
        r = request(f"{gw.url}/v1/chat/completions", "POST", {
            "model": "chat-default", "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": f"dashboard traffic {'abcd'[i]}"}]}, auth)
        assert r.status == 200
        time.sleep(1.2)
    dashboard = json.loads((Path(__file__).parents[3] / "deploy/grafana/dashboards/llmgw.json").read_text())
    exprs = {p["title"]: t["expr"].replace("$__rate_interval", "1m") for p in dashboard["panels"] for t in p["targets"]}
    assert len(exprs) >= 8
    for expr in exprs.values():
        query(prometheus, expr)  # valid PromQL (a 400 fails the test)
    for title in ("Time to first token, p95 by route (s)", "Settled requests per second, by termination",
                  "Tokens per second, by type"):
        result = wait_for(prometheus, exprs[title])
        assert result and all(float(s["value"][1]) > 0 for s in result), (title, result)  # type: ignore[index]
