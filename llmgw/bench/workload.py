"""Traces of work (issue 15, part 1): the JSON-lines format `llmgw bench run` replays, and a seeded
generator of production-shaped traces.

One line per request, in arrival order:

    {"at": 0.125, "request_class": "read_only_chat", "route": "chat-default", "tenant": "acme",
     "data_class": "internal", "input_tokens": 812, "output_tokens": 190, "prefix_group": 3,
     "stream": true, "tools": false, "cancel_after_s": null, "idempotency_key": null}

`at` is the arrival offset in seconds from the trace's start. Requests of one `prefix_group` share
a leading system prompt (the prefix cache's case); `cancel_after_s` is when the client hangs up
(null: it waits for the answer); `idempotency_key` is sent as the header of that name.

The generator draws arrivals as a Poisson process or a bursty one (a two-state Markov-modulated
Poisson process: calm and burst rates, exponential sojourns), request classes from a mix, input
and output lengths from log-normal distributions (heavy right tails, as production traffic has),
prefix groups with a reuse share, and cancellations. The same seed gives the same trace.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TraceRecord:
    at: float
    request_class: str
    route: str
    tenant: str
    data_class: str
    input_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    stream: bool = True
    tools: bool = False
    cancel_after_s: float | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True)
class ClassShape:
    """One request class of the mix: its share, route, and length distributions (log-normal with
    this median and sigma: p95 = median * e^(1.645 sigma)), capped."""

    name: str
    share: float
    route: str = "chat-default"
    input_median: int = 600
    input_sigma: float = 0.8
    output_median: int = 180
    output_sigma: float = 0.7
    max_input: int = 32_000
    max_output: int = 4_096
    stream_share: float = 0.8
    tools_share: float = 0.0


@dataclass(frozen=True)
class TraceShape:
    rate_rps: float = 5.0  # mean arrival rate
    duration_s: float = 60.0
    arrivals: str = "poisson"  # or "bursty"
    burst_factor: float = 4.0  # bursty: the burst state's rate over the calm state's
    burst_share: float = 0.2  # bursty: the share of time in bursts
    mean_sojourn_s: float = 5.0  # bursty: how long a state lasts, on average
    classes: tuple[ClassShape, ...] = (ClassShape("read_only_chat", 1.0),)
    tenants: Mapping[str, float] | None = None  # tenant -> share (default: acme only)
    data_class: str = "internal"
    prefix_groups: int = 8
    prefix_share: float = 0.5  # requests that reuse one of the groups' prefixes
    cancel_share: float = 0.02
    idempotent_share: float = 0.0


def _arrivals(shape: TraceShape, rng: random.Random) -> Iterator[float]:
    t = 0.0
    if shape.arrivals == "poisson":
        while True:
            t += rng.expovariate(shape.rate_rps)
            if t >= shape.duration_s:
                return
            yield t
    if shape.arrivals != "bursty":
        raise ValueError(f"arrivals: poisson or bursty, not {shape.arrivals!r}")
    # Calm rate c and burst rate b = factor * c with the mean rate preserved:
    # (1 - share) c + share b = rate.
    calm = shape.rate_rps / (1 - shape.burst_share + shape.burst_share * shape.burst_factor)
    rates = {False: calm, True: calm * shape.burst_factor}
    # Sojourns with means in the ratio of the shares, so the long-run share in bursts is burst_share.
    means = {False: shape.mean_sojourn_s, True: shape.mean_sojourn_s * shape.burst_share / (1 - shape.burst_share)}
    burst, switch = False, rng.expovariate(1 / means[False])
    while t < shape.duration_s:
        nxt = t + rng.expovariate(rates[burst])
        if nxt >= switch:  # memoryless: restart the draw from the switch in the new state
            t, burst = switch, not burst
            switch = t + rng.expovariate(1 / means[burst])
            continue
        t = nxt
        if t < shape.duration_s:
            yield t


def _pick(rng: random.Random, shares: Mapping[str, float]) -> str:
    return rng.choices(list(shares), weights=list(shares.values()))[0]


def _length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def generate(shape: TraceShape, seed: int) -> list[TraceRecord]:
    """A trace of `shape`; the same seed gives the same trace."""
    rng = random.Random(seed)
    classes = {c.name: c for c in shape.classes}
    tenants = dict(shape.tenants or {"acme": 1.0})
    out = []
    for i, at in enumerate(_arrivals(shape, rng)):
        cls = classes[_pick(rng, {c.name: c.share for c in shape.classes})]
        output = _length(rng, cls.output_median, cls.output_sigma, cls.max_output)
        stream = rng.random() < cls.stream_share
        cancel = None
        if rng.random() < shape.cancel_share:
            cancel = round(rng.uniform(0.05, 2.0), 3)
        out.append(TraceRecord(
            at=round(at, 6), request_class=cls.name, route=cls.route, tenant=_pick(rng, tenants),
            data_class=shape.data_class, input_tokens=_length(rng, cls.input_median, cls.input_sigma, cls.max_input),
            output_tokens=output,
            prefix_group=rng.randrange(shape.prefix_groups) if rng.random() < shape.prefix_share else None,
            stream=stream, tools=rng.random() < cls.tools_share, cancel_after_s=cancel,
            idempotency_key=f"trace-{seed}-{i}" if rng.random() < shape.idempotent_share else None))
    return out


def write(records: Iterable[TraceRecord], path: Path) -> int:
    n = 0
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")
            n += 1
    return n


def read(path: Path) -> list[TraceRecord]:
    """A trace file, checked: every field known, arrivals in order (an error names the line)."""
    out: list[TraceRecord] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc: dict[str, Any] = json.loads(line)
            rec = TraceRecord(**doc)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a trace record: {e}") from None
        if out and rec.at < out[-1].at:
            raise ValueError(f"{path}:{n}: arrival {rec.at} before the previous one ({out[-1].at})")
        out.append(rec)
    return out
