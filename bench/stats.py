"""The arithmetic of the bench: medians, percentiles, ratios and the A/B alternation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (the mean of the two middle ones for an even count)."""
    return percentile(values, 50)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    The same definition as numpy's default (``method="linear"``), without numpy.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    if low == high:
        return float(ordered[low])
    weight = position - low
    return float(ordered[low] * (1 - weight) + ordered[high] * weight)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def alternated(systems: Sequence[T], round_index: int) -> list[T]:
    """The order in which ``systems`` run in round ``round_index``: rotated by one each round.

    Over ``len(systems)`` rounds every system runs once in every position, so a
    drift of the machine (a warming cache, a neighbour's load) spreads evenly
    instead of always favouring the system that runs first.
    """
    if not systems:
        return []
    shift = round_index % len(systems)
    return [*systems[shift:], *systems[:shift]]
