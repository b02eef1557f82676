"""The few statistics and number formats the benchmarks share: nearest-rank percentiles, a
median that skips what is missing, and a table cell for a number that may be missing.

Nearest rank, never interpolated: a percentile is always one of the values measured (the
p99 of 100 latencies is the 99th smallest), so a table's p99 is a latency some request had.

>>> percentile([3.0, 1.0, 2.0, 4.0], 50), p99([float(i) for i in range(1, 201)])
(2.0, 198.0)
>>> median([None, 3.0, 1.0]), median([]), fmt(None), fmt(2.345, 2)
(2.0, None, '-', '2.35')
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

__all__ = ["fmt", "median", "p99", "percentile"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100] of ``values``; ``None`` for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[min(len(ordered), max(rank, 1)) - 1]


def p99(values: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile; ``None`` for none."""
    return percentile(values, 99)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (``None`` skipped); ``None`` for none."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def fmt(value: float | None, digits: int = 1) -> str:
    """A table cell: ``value`` with ``digits`` decimals, ``-`` where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"
