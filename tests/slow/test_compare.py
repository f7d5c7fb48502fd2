"""`llmgw bench compare` (issue 15, part 5): two configurations differing in one mechanism on the same
trace, repeated in A B B A order, reported as B - A with its spread; here prefix caching on against
off, whose effect the engines' own counters show without timing noise."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmgw.bench.compare import Row, compare, parse_spec, render
from llmgw.bench.workload import TraceRecord, write
from tests.conftest import POLICY
from tests.helpers import llmgw

pytestmark = pytest.mark.e2e


def test_specs_and_the_arithmetic_of_a_difference() -> None:
    assert parse_spec("lb=round_robin,prefix_caching=off") == {"lb": "round_robin", "prefix_caching": "off"}
    for bad in ("colour=blue", "lb=random", "prefix_caching=maybe", "lb"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    a = [{"m": 10.0}, {"m": 12.0}]
    b = [{"m": 15.0}, {"m": 13.0}]
    (row,) = compare(a, b)
    assert (row.a, row.b, row.diff, row.spread) == (11.0, 14.0, 3.0, 2.0)  # diffs 5 and 1
    assert row.finding
    assert not Row("m", 1, 2, 1.0, 1.5).finding  # within its spread: not a finding
    assert "| m | 11.0 | 14.0 | +3.0 | 2.0 | difference |" in render([row], "x", "y", 2)


def test_prefix_caching_on_against_off_on_the_same_trace(tmp_path: Path) -> None:
    # Requests sharing a long system prompt (prefix group 0), one at a time.
    trace = [TraceRecord(at=i * 0.3, request_class="chat", route="chat-default", tenant="acme",
                         data_class="internal", input_tokens=600, output_tokens=4, prefix_group=0, stream=True)
             for i in range(6)]
    path = tmp_path / "trace.jsonl"
    write(trace, path)
    out = llmgw("bench", "compare", str(path), "--a", f"config={POLICY},prefix_caching=on",
                "--b", f"config={POLICY},prefix_caching=off", "--repeats", "2", "--time-scale", "0.05",
                "--output", str(tmp_path / "compare.md"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:7] for line in out.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| metric")}
    on, off = float(rows["prefix cache hit %"][0]), float(rows["prefix cache hit %"][1])
    assert on > 20 and off == 0  # the mechanism differs, and only it
    assert float(rows["answered %"][0]) == float(rows["answered %"][1]) == 100
    assert not math.isnan(float(rows["TTFT p50 ms"][0]))
    assert (tmp_path / "compare.md").read_text() == out.stdout.strip() + "\n"
