"""Open-loop replay (issue 15, part 2) through a real gateway: the schedule is kept when the pool is
slow - answers taking seconds do not lower the offered load - and `llmgw bench run` reports the
classes, the percentiles and the cost per accepted task from the ledger."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.bench.openloop import replay
from llmgw.bench.workload import TraceRecord, write
from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, start_stack
from tests.helpers import clear_faults, llmgw, request

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("openloop"))
    up = s.write_up_json()  # as `llmgw up` writes it, with the suite's keys (made before the stack)
    up.write_text(json.dumps({**json.loads(up.read_text()), "tenants": {t: {"api_key": k}
                                                                          for t, k in DEMO_KEYS.items()}}))
    yield s
    s.stop()


def trace(n: int, every_s: float, stream: bool = False, request_class: str = "read_only_chat") -> list[TraceRecord]:
    return [TraceRecord(at=i * every_s, request_class=request_class, route="chat-default", tenant="acme",
                        data_class="internal", input_tokens=40, output_tokens=4, stream=stream) for i in range(n)]


@pytest.mark.serial  # the generator's own lateness is measured: other workers' load must not delay it
def test_a_slow_pool_does_not_lower_the_offered_load(gw: Stack) -> None:
    engines = gw.engine_urls("engine-pool")
    for url in engines:  # every answer takes 2 s: a closed-loop client would send far fewer
        assert request(f"{url}/admin/faults", "POST", {"fault": "delay_ms=2000", "count": 100}).status == 200
    try:
        schedule = trace(30, 0.05)  # 20 requests/s for 1.5 s
        outcomes = asyncio.run(replay(f"{gw.url}/v1/chat/completions", {"acme": DEMO_KEYS["acme"]}, schedule))
    finally:
        clear_faults(engines)
    assert len(outcomes) == 30
    assert max(o.late_s for o in outcomes) < 0.25, [round(o.late_s, 3) for o in outcomes]
    assert all(o.status == 200 for o in outcomes), [(o.status, o.code) for o in outcomes]
    assert min(o.e2e_s or 0 for o in outcomes) >= 2.0  # the answers were slow; the sends were not


def test_bench_run_reports_classes_percentiles_and_the_ledger_s_cost(gw: Stack, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    write([*trace(6, 0.1, stream=True), *(TraceRecord(**{**r.__dict__, "at": r.at + 0.05})
                                          for r in trace(4, 0.1, request_class="batch"))], path)
    records = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda d: d["at"])
    path.write_text("".join(json.dumps(d) + "\n" for d in records))
    out = llmgw("bench", "run", str(path), "--state-dir", str(gw.opts.state_dir), "--cache", "both",
                "--json", str(tmp_path / "run.json"))
    assert out.returncode == 0, out.stderr + out.stdout
    assert "### cold cache" in out.stdout and "### warm cache" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| read_only_chat", "| batch"))]
    assert len(rows) == 4 and all("| 100.0% | 0.0% | 0.0% | 0.0% |" in row for row in rows), rows
    stream_row = next(r for r in rows if r.startswith("| read_only_chat"))
    assert stream_row.split("|")[7].strip() != "- / - / -"  # TTFT measured for the streams
    costs = [float(c) for c in re.findall(r"cost per accepted task \(ledger\): ([0-9.]+)", out.stdout)]
    assert len(costs) == 2 and all(c > 0 for c in costs), out.stdout
    run = json.loads((tmp_path / "run.json").read_text())
    assert [len(run[p]) for p in ("cold", "warm")] == [10, 10]
    assert all(r["output_tokens"] == 4 for p in run.values() for r in p)  # the trace's lengths, exactly
