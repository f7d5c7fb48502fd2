"""Prometheus text exposition, parsed just enough for assertions (label order never matters)."""

from __future__ import annotations

import re

from tests.helpers import request

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, frozenset[tuple[str, str]]]


def parse(text: str) -> dict[Sample, float]:
    out: dict[Sample, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and not line.startswith("#"):
            labels = frozenset(_LABEL.findall(m.group("labels") or ""))
            out[(m.group("name"), labels)] = float(m.group("value"))
    return out


def scrape(url: str) -> dict[Sample, float]:
    return parse(request(f"{url}/metrics").body.decode())


def value(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """The sum over every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    if not found:
        raise KeyError(f"no sample {name} {labels}")
    return sum(found)


def store_rounds(metrics_url: str, operation: str) -> float:
    """How many store round trips of one kind a stack's workers made (llmgw_store_duration_seconds)."""
    try:
        return value(parse(request(metrics_url).body.decode()), "llmgw_store_duration_seconds_count",
                     operation=operation)
    except KeyError:  # none of that kind yet
        return 0.0


def names(samples: dict[Sample, float]) -> set[str]:
    return {n for n, _ in samples}


def label_names(samples: dict[Sample, float], name: str) -> set[str]:
    return {k for (n, ls), _ in samples.items() if n == name for k, _ in ls}
