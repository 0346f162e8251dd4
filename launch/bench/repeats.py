"""Repeated measurements summarised one way for every benchmark: min / median / max."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

__all__ = ["spread"]


def spread(times: Iterable[float]) -> dict:
    """``{"min", "median", "max", "repeats"}`` of repeated measurements, in their unit. The median is
    the figure tables and ratios use; min and max show how still the measurement held."""
    times = list(times)
    if not times:
        raise ValueError("times: expected at least one measurement, got none")
    return {"min": min(times), "median": statistics.median(times), "max": max(times), "repeats": len(times)}
