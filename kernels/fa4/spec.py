"""Which of our FA4 changes a traced kernel gets: the ``mask_mod`` functions registered as FlashMask's,
each with its shape class and :class:`Options` (no FA4 or CUTLASS import here).

:mod:`.column_masking` and :mod:`.cost_schedule` look a traced kernel's ``mask_mod`` up here
(:func:`spec_of`); :mod:`.mask_mod` registers each one it builds; :data:`traced` counts, at trace time,
what the kernels were traced with (for tests and the compile check).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = ["SCHEDULES", "FlashMaskSpec", "Options", "register", "spec_of", "traced"]


# How the CTAs of a FlashMask kernel are ordered: "cost" (heaviest first from the block lists, both
# passes), "reversed" (FA4's LPT scheduler on the forward: query blocks in reverse; the backward in grid
# order; what this module did before "cost"), "grid" (FA4's own order).
SCHEDULES = ("cost", "reversed", "grid")


@dataclass(frozen=True)
class Options:
    """Which changes a ``mask_mod`` gets (both by default): column-first masking, and the schedule."""

    column_first: bool = True
    schedule: str = "cost"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")


@dataclass(frozen=True)
class FlashMaskSpec:
    """What the column-first masking must know about a FlashMask ``mask_mod`` (its shape class)."""

    batch_broadcast: bool  # Bm == 1: row 0 of the bounds serves every batch entry
    q_per_mask_head: int  # query heads per mask head
    intervals: int  # M, 1..4
    explicit_rows: bool  # rows read from aux_tensors[1]; else the local query index is the row
    options: Options = Options()


_SPECS: dict[int, tuple[object, FlashMaskSpec]] = {}  # id(mask_mod) -> (mask_mod kept alive, spec)
# What kernels were traced with, counted at trace time (never at run time): "column_first" /
# "per_score" masking of FlashMask partial tiles, with "_transposed" for the backward's S^T layout,
# and the schedules: "cost_order" / "reversed_order" / "grid_order" (forward), the same with "_bwd"
# (backward; "reversed" leaves it in grid order). For tests and the compile check.
traced: collections.Counter = collections.Counter()


def register(mask_mod, spec: FlashMaskSpec) -> None:
    """Mark ``mask_mod`` as FlashMask's: kernels traced with it get the changes ``spec.options`` asks for."""
    _SPECS[id(mask_mod)] = (mask_mod, spec)


def spec_of(mask_mod) -> FlashMaskSpec | None:
    entry = _SPECS.get(id(mask_mod)) if mask_mod is not None else None
    return entry[1] if entry is not None and entry[0] is mask_mod else None
