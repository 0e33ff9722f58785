"""Helpers shared by the benchmarks: interleaved rounds, robust summaries, plain-text tables.

The benchmarks run on shared machines, so every comparison is made from variants measured in alternation (ABC,
BCA, CAB, ...), summarised by the median of rounds (with a confidence interval, or the spread of the rounds,
printed next to it).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["fmt_seconds", "machine", "median", "median_ci", "rotated", "spread", "table"]

T = TypeVar("T")


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """The variants in the order of one round: each round starts one variant later (ABC, BCA, CAB, ...), so no
    variant is always first (cold) or always last."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_ci(values: Sequence[float]) -> tuple[float, float]:
    """A 95% confidence interval for the median of ``values``, from their order statistics (no assumption about
    their distribution): the sorted values at ranks n/2 -+ 0.98 sqrt(n), the normal approximation of the binomial."""
    ordered = sorted(values)
    n = len(ordered)
    if n < 3:
        return (ordered[0], ordered[-1]) if ordered else (float("nan"), float("nan"))
    half = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half))
    high = min(n - 1, math.ceil(n / 2 + half))
    return ordered[low], ordered[high]


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of the rounds, as a fraction: how far apart the rounds were."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else float("nan")


def fmt_seconds(seconds: float | None) -> str:
    """A latency for a table: ms below one second, s above, '-' for none."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"
    return f"{seconds:.2f} s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """A plain-text table (also valid Markdown): the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1)) + ":" if i >= left else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def machine() -> str:
    """One line describing where the figures come from."""
    load = ""
    if hasattr(os, "getloadavg"):
        one, five, _ = os.getloadavg()
        load = f", load average {one:.2f} (1 min) {five:.2f} (5 min) at start"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}{load}"
    )
