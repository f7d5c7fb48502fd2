"""What an Exchange holds of its budget reservation: a value the budget stage makes, and the bounds,
the stream guard and settlement read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Held:
    """What the Exchange knows of its reservation (the store holds the rest)."""

    micros: int
    tokens: int
    prompt_bound: int
    max_tokens: int  # of each completion
    n: int  # completions
    price_version: str
    hint: str  # the keys settlement touches (extproc.store.Reservation.hint), for the meter
    idempotent: bool

    def with_hint(self, **extra: Any) -> Held:
        """The same reservation with what settlement also gives back (a pool slot, a provider quota's
        hold) named in its hint; a key given None is taken out."""
        hint = {**orjson.loads(self.hint), **extra}
        return replace(self, hint=orjson.dumps({k: v for k, v in hint.items() if v is not None}).decode())
