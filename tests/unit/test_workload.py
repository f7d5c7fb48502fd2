"""Traces of work (issue 15, part 1): the generator is seeded and reproducible, its arrivals have the
rate and burstiness asked for, lengths and the class mix follow their shapes, and the file format
round-trips and rejects what it does not know."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from llmgw.bench.workload import ClassShape, TraceShape, generate, read, write

MIX = TraceShape(rate_rps=20, duration_s=300, classes=(ClassShape("chat", 0.7), ClassShape(
    "agent", 0.3, input_median=3000, output_median=400, tools_share=1.0)), tenants={"acme": 0.75, "globex": 0.25})


def test_the_same_seed_gives_the_same_trace() -> None:
    assert generate(MIX, 7) == generate(MIX, 7)
    assert generate(MIX, 7) != generate(MIX, 8)


def counts_per_second(at: list[float], duration: float) -> list[int]:
    bins = [0] * int(duration)
    for t in at:
        bins[int(t)] += 1
    return bins


def test_poisson_and_bursty_arrivals_have_the_mean_rate_and_their_dispersion() -> None:
    poisson = generate(MIX, 1)
    n = len(poisson)
    assert abs(n - 20 * 300) < 4 * (20 * 300) ** 0.5  # within 4 sigma of the expected count
    assert all(a.at < b.at for a, b in itertools.pairwise(poisson))
    counts = counts_per_second([r.at for r in poisson], 300)
    assert 0.7 < statistics.variance(counts) / statistics.mean(counts) < 1.4  # Poisson: variance = mean
    bursty = generate(TraceShape(rate_rps=20, duration_s=600, arrivals="bursty", burst_factor=5, burst_share=0.2), 1)
    assert abs(len(bursty) / 600 - 20) < 3  # the mean rate is kept
    counts = counts_per_second([r.at for r in bursty], 600)
    assert statistics.variance(counts) / statistics.mean(counts) > 3  # over-dispersed: bursts


def test_lengths_mix_and_tenants_follow_their_shapes() -> None:
    trace = generate(MIX, 3)
    chat = [r for r in trace if r.request_class == "chat"]
    agent = [r for r in trace if r.request_class == "agent"]
    assert abs(len(agent) / len(trace) - 0.3) < 0.03
    assert abs(statistics.median(r.input_tokens for r in chat) / 600 - 1) < 0.1
    assert abs(statistics.median(r.input_tokens for r in agent) / 3000 - 1) < 0.15
    assert all(r.tools for r in agent) and not any(r.tools for r in chat)
    assert abs(sum(r.tenant == "globex" for r in trace) / len(trace) - 0.25) < 0.03
    assert 0.4 < sum(r.prefix_group is not None for r in trace) / len(trace) < 0.6
    assert 0 < sum(r.cancel_after_s is not None for r in trace) < 0.05 * len(trace)


def test_the_file_round_trips_and_rejects_unknown_fields_and_disorder(tmp_path: Path) -> None:
    trace = generate(MIX, 5)[:50]
    path = tmp_path / "trace.jsonl"
    assert write(trace, path) == 50
    assert read(path) == trace
    lines = path.read_text().splitlines()
    bad = json.loads(lines[3]) | {"colour": "blue"}
    path.write_text("\n".join([*lines[:3], json.dumps(bad), *lines[4:]]))
    with pytest.raises(ValueError, match=r"trace.jsonl:4: not a trace record"):
        read(path)
    path.write_text("\n".join([lines[1], lines[0]]))
    with pytest.raises(ValueError, match=r"trace.jsonl:2: arrival .* before the previous one"):
        read(path)
