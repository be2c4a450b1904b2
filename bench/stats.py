"""Small statistics helpers: percentiles, summaries, and bootstrap confidence intervals.

Pure Python plus `random` (seeded), so results are reproducible and nothing
here needs numpy. Used by the report (percentile tables) and by compare
(bootstrap intervals of the relative change between two runs).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def summary_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p95/p99/mean/max in milliseconds (rounded to 0.01 ms) and the count."""
    out: dict[str, float | int | None] = {"n": len(values_s)}
    for q in PERCENTILES:
        p = percentile(values_s, q)
        out[f"p{q}"] = None if p is None else round(p * 1e3, 3)
    m = mean(values_s)
    out["mean"] = None if m is None else round(m * 1e3, 3)
    out["max"] = round(max(values_s) * 1e3, 3) if values_s else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def bootstrap_relative_change(
    base: Sequence[float],
    cand: Sequence[float],
    stat: Callable[[Sequence[float]], float | None] = mean,
    *,
    iterations: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float] | None:
    """(point, low, high) of stat(cand)/stat(base) - 1, by resampling each side.

    Independent resampling of the two samples with replacement (percentile
    bootstrap). None when either side is empty or its statistic is zero.
    """
    if not base or not cand:
        return None
    sb, sc = stat(base), stat(cand)
    if not sb or sc is None:
        return None
    rng = random.Random(seed)
    nb, nc = len(base), len(cand)
    changes: list[float] = []
    for _ in range(max(1, iterations)):
        b = stat([base[rng.randrange(nb)] for _ in range(nb)])
        c = stat([cand[rng.randrange(nc)] for _ in range(nc)])
        if b and c is not None:
            changes.append(c / b - 1.0)
    if not changes:
        return None
    alpha = (1.0 - confidence) / 2.0
    low = percentile(changes, 100 * alpha)
    high = percentile(changes, 100 * (1 - alpha))
    assert low is not None and high is not None
    return sc / sb - 1.0, low, high
