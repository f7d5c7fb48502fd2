"""extproc/tracing.py on its own: spans made with the ids decided at admission, after the fact, into
the JSON-lines file `llmgw up` uses; the sampler keeps or drops a trace's spans together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc import tracing


@pytest.fixture
def traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "traces.jsonl"
    monkeypatch.setenv("LLMGW_TRACES_FILE", str(path))
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setattr(tracing, "_pipeline", None)
    return path


def read(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_request_span_has_the_id_decided_at_admission_and_its_attempts_are_children(traces: Path) -> None:
    assert tracing.init()
    trace_id, span_id, client = tracing.new_trace_id(), tracing.new_span_id(), tracing.new_span_id()
    ctx = tracing.context_value(trace_id, span_id, client)
    tracing.attempt_span(ctx, "model-a", 100.0, 100.5, {"llmgw.attempt.n": 1, "llmgw.ledger.request_id": "r1"})
    tracing.request_span(ctx, "chat-default", 99.9, 101.0, {"llmgw.ledger.request_id": "r1", "empty": ""})
    tracing.shutdown()
    attempt, request = read(traces)
    assert request == {"trace_id": trace_id, "span_id": span_id, "parent_id": client, "name": "chat chat-default",
                       "kind": "SERVER", "start_ns": 99_900_000_000, "end_ns": 101_000_000_000,
                       "attributes": {"llmgw.ledger.request_id": "r1"}}  # empty values are not attributes
    assert attempt["trace_id"] == trace_id and attempt["parent_id"] == span_id and attempt["kind"] == "CLIENT"
    assert attempt["span_id"] != span_id


def test_sampling_keeps_or_drops_a_traces_spans_together(traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_TRACE_SAMPLE_RATIO", "0.5")
    assert tracing.init()
    kept = set()
    for _ in range(200):
        ctx = tracing.context_value(tracing.new_trace_id(), tracing.new_span_id(), "")
        tracing.attempt_span(ctx, "m", 1.0, 2.0, {})
        tracing.request_span(ctx, "r", 1.0, 2.0, {})
    tracing.shutdown()
    spans = read(traces)
    by_trace: dict[object, int] = {}
    for s in spans:
        by_trace[s["trace_id"]] = by_trace.get(s["trace_id"], 0) + 1
        kept.add(s["trace_id"])
    assert set(by_trace.values()) == {2}  # both spans of a kept trace, never one
    assert 40 < len(kept) < 160  # about half of the 200 traces


def test_nothing_is_made_without_an_exporter(traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_TRACES_FILE")
    assert not tracing.init()
    tracing.request_span(tracing.context_value(tracing.new_trace_id(), tracing.new_span_id(), ""), "r", 1, 2, {})
    assert not traces.exists()
