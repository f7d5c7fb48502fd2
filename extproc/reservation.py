"""What an Exchange holds of its budget reservation: a value the budget stage makes, and the bounds,
the stream guard and settlement read."""

from __future__ import annotations

from dataclasses import dataclass


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
