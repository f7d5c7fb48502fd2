"""The ext_proc worker with decision stages left out, for `llmgw bench ablate` only: the benchmark's
stack runs `python -m llmgw.bench.ablated_extproc` with the worker's own arguments.

LLMGW_ABLATE_STAGES: stage names (`extproc/stages`' `name`s), comma-separated, that are not built.
LLMGW_ABLATE_FIXED_REPLY: when set, the first decision is made in full and its reply, less the key
that sends it to settlement, answers every later request: what the ext_proc round trip costs alone.
LLMGW_ABLATE_SCRAPE_S: the engine picker's scrape interval while traffic runs (its idle pace, 1 s,
prices the scraping's share of a slow stream's cost).
LLMGW_ABLATE_NO_SLICES: when set, no request is admitted from a slice (extproc/slices.py, a pool's
slot slices): each reserves in the store and waits for it, as before slices - what they save.
LLMGW_ABLATE_TIMES: a file the worker writes at exit, each stage's summed wall time in the decision
(microseconds, awaits included) and the number of decisions: every stage's in-place cost.

The data plane has no such switch: a worker a user runs always runs every stage."""

from __future__ import annotations

import atexit
import json
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc import admission, picker, server, slices
from extproc.exchange import Exchange
from extproc.names import METADATA_NAMESPACE, Key
from extproc.pipeline import build_stages, run_stages
from extproc.service import decision
from extproc.stages import Stage

SKIPPED = frozenset(filter(None, os.environ.get("LLMGW_ABLATE_STAGES", "").split(",")))
_spent: Counter[str] = Counter()
_decisions = Counter[str]()


def _built(*args: object, **kw: object) -> tuple[Stage, ...]:
    stages = build_stages(*args, **kw)  # type: ignore[arg-type]
    unknown = SKIPPED - {s.name for s in stages}
    if unknown:
        raise SystemExit(f"ablated_extproc: no stage named {sorted(unknown)}")
    return tuple(s for s in stages if s.name not in SKIPPED)


async def _timed(stages: Sequence[Stage], ex: Exchange, start: int = 0) -> int | None:
    try:
        return await run_stages(stages, ex, start)
    finally:
        _spent.update(ex.stage_us)
        _decisions["n"] += start == 0


_decide = decision.DecisionFilter.decide
_fixed: list[ep.ProcessingResponse] = []


async def _fixed_reply(self: decision.DecisionFilter, first: ep.ProcessingRequest,
                       _rest: AsyncIterator[ep.ProcessingRequest]) -> AsyncGenerator[ep.ProcessingResponse, None]:
    if _fixed:
        yield _fixed[0]
        return
    async for reply in _decide(self, first, _rest):
        fixed = ep.ProcessingResponse()
        fixed.CopyFrom(reply)
        ours = fixed.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
        if Key.SETTLE in ours.fields:
            del ours.fields[Key.SETTLE]
        _fixed.append(fixed)
        yield reply


def _write_times() -> None:
    if path := os.environ.get("LLMGW_ABLATE_TIMES"):
        Path(path).write_text(json.dumps({"decisions": _decisions["n"], "stage_us": dict(_spent)}))


if os.environ.get("LLMGW_ABLATE_FIXED_REPLY"):
    decision.DecisionFilter.decide = _fixed_reply  # type: ignore[method-assign]
if os.environ.get("LLMGW_ABLATE_SCRAPE_S"):
    _SCRAPE_S = float(os.environ["LLMGW_ABLATE_SCRAPE_S"])

    class _SlowerPicker(picker.Picker):
        def __init__(self, pools: Any, **kw: Any) -> None:
            super().__init__(pools, **{**kw, "interval": _SCRAPE_S})

    server.Picker = _SlowerPicker  # type: ignore[misc,assignment]
if os.environ.get("LLMGW_ABLATE_NO_SLICES"):
    async def _never(*_args: Any, **_kw: Any) -> Any:
        return None

    slices.SliceBook.admit = _never  # type: ignore[method-assign]
    admission.PoolGate._from_slice = _never  # type: ignore[method-assign]
decision.build_stages = _built
decision.run_stages = _timed
atexit.register(_write_times)
server.main()
