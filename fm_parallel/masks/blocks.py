"""Block summary of a FlashMask and the tile rule (skip / partial / fully visible).

This module is the only place that decides what a tile of (query rows x key block) is. The PyTorch
path calls :func:`classify_tiles`; the kernels' launch plans and FA4's block lists
(``fm_parallel.kernels.plan``, ``.fa4.sparsity``, ``.triton.plan``) take their classes from
:func:`tile_classes` (any rows) or :func:`consecutive_tile_ranges` + :func:`classes_in_ranges`
(consecutive rows, without the dense tile grid). The ring scheduler does not classify tiles: it
skips a transfer from the exact pair counts (``fm_parallel.distributed.sharding.pair_counts``).

For key block ``c`` (columns ``c*Bc .. c*Bc+Bc-1``) and interval slot ``m`` the summary keeps
``min/max`` of ``fms`` and ``fme`` over the block's columns. For rows ``[r_lo, r_hi]``:

* **skip**    if for every slot ``m``: ``min_fms[m] > r_hi`` or ``max_fme[m] < r_lo``
  (no column's interval ``m`` reaches the rows);
* **full**    if for some slot ``m``: ``max_fms[m] <= r_lo`` and ``min_fme[m] >= r_hi``
  (interval ``m`` of every column covers every row);
* **partial** otherwise.

Both tests are conservative, so a partial tile may in truth be empty or full, never the converse.
Rows need not be contiguous: a block of zigzag positions is summarised by its min and max row.

For the kernels, a ragged last key block (``Nk % Bc != 0``) is never **full**: its missing columns
must be masked in registers. :func:`tile_classes` and :func:`consecutive_tile_ranges` read such a
block as if its missing columns were empty columns (``_kernel_summary``), so the grid and the range
forms apply that amendment in one place.

With several intervals per column, slot ``m`` of one column and slot ``m`` of the next need not be
alike (sinks or global tokens merge into one interval in some columns and not in others), so a tile
every column covers through *different* slots would read as partial. The summary therefore holds one
more slot, a **cover slot**: each column's longest interval, reduced like the others for the full
test only (its reach bounds are empty, so it never makes a tile partial or visited by itself). A
tile is full when it lies inside every column's longest interval, which is still never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: flashmask.py imports this module (lazily) for block_summary
    from fm_parallel.masks.flashmask import FlashMask

__all__ = ["tile_ranges", "TileClass", "BlockSummary", "summarize", "classify_tiles", "row_block_bounds", "count_tiles",
           "tile_classes", "consecutive_tile_ranges", "classes_in_ranges"]


class TileClass(IntEnum):
    SKIP = 0
    PARTIAL = 1
    FULL = 2


@dataclass(frozen=True)
class BlockSummary:
    """Per key block and interval slot: bounds of ``fms`` / ``fme``, each ``[B, Hm, Tc, S]`` int32, with
    ``S = M`` slots for one interval per column and ``M + 1`` (the cover slot last) for more."""

    block: int
    num_keys: int
    min_fms: torch.Tensor
    max_fms: torch.Tensor
    min_fme: torch.Tensor
    max_fme: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.min_fms.shape[2]


def summarize(mask: FlashMask, block: int) -> BlockSummary:
    """O(N) reduction of the bounds over key blocks of ``block`` columns (last block may be short)."""
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block: expected a positive int, got {block!r}")
    b, h, n, m = mask.fms.shape
    tc = -(-n // block)
    pad = tc * block - n
    big, small = torch.iinfo(torch.int32).max, torch.iinfo(torch.int32).min

    def reduce(x: torch.Tensor, fill: int, op) -> torch.Tensor:
        # Padding columns take the neutral value of the reduction so the short last block is exact.
        slots = x.shape[-1]
        if pad:
            x = torch.cat([x, torch.full((b, h, pad, slots), fill, dtype=x.dtype, device=x.device)], dim=2)
        return op(x.view(b, h, tc, block, slots), dim=3)

    amin = lambda x, dim: x.amin(dim=dim)  # noqa: E731
    amax = lambda x, dim: x.amax(dim=dim)  # noqa: E731
    min_fms, max_fms = reduce(mask.fms, big, amin), reduce(mask.fms, small, amax)
    min_fme, max_fme = reduce(mask.fme, big, amin), reduce(mask.fme, small, amax)
    if m > 1:  # the cover slot (module docstring); one interval per column needs none
        length = (mask.fme.to(torch.int64) - mask.fms.to(torch.int64)).clamp(min=-1)  # empty: -1 or less
        pick = length.argmax(dim=-1, keepdim=True)  # the longest (an empty column picks an empty one)
        cover_fms, cover_fme = mask.fms.gather(-1, pick), mask.fme.gather(-1, pick)  # [B, H, N, 1]
        cover_max_fms, cover_min_fme = reduce(cover_fms, small, amax), reduce(cover_fme, big, amin)
        never = lambda x, value: torch.full_like(x, value)  # noqa: E731 - reach bounds that reach nothing
        min_fms = torch.cat([min_fms, never(cover_max_fms, big)], dim=-1)
        max_fms = torch.cat([max_fms, cover_max_fms], dim=-1)
        min_fme = torch.cat([min_fme, cover_min_fme], dim=-1)
        max_fme = torch.cat([max_fme, never(cover_min_fme, small)], dim=-1)
    return BlockSummary(block=block, num_keys=n, min_fms=min_fms, max_fms=max_fms, min_fme=min_fme, max_fme=max_fme)


def classify_tiles(summary: BlockSummary, row_lo: torch.Tensor, row_hi: torch.Tensor) -> torch.Tensor:
    """The tile rule.

    Args:
        summary: block summary of the mask (``[B, Hm, Tc, M]`` bounds).
        row_lo, row_hi: ``[Tr]`` smallest / largest global row of each query block (inclusive).
    Returns:
        ``[B, Hm, Tr, Tc]`` int8 of :class:`TileClass` values.
    """
    lo = row_lo.to(summary.min_fms.device, torch.int32).view(1, 1, -1, 1, 1)
    hi = row_hi.to(summary.min_fms.device, torch.int32).view(1, 1, -1, 1, 1)
    min_fms, max_fms = summary.min_fms.unsqueeze(2), summary.max_fms.unsqueeze(2)  # [B, Hm, 1, Tc, M]
    min_fme, max_fme = summary.min_fme.unsqueeze(2), summary.max_fme.unsqueeze(2)
    reaches = (min_fms <= hi) & (max_fme >= lo)
    covers = (max_fms <= lo) & (min_fme >= hi)
    return _class_of(covers.any(-1), reaches.any(-1))


def _class_of(covers: torch.Tensor, reaches: torch.Tensor) -> torch.Tensor:
    """int8 :class:`TileClass`: FULL where some slot covers the tile, PARTIAL where some slot reaches
    it (and none covers), SKIP elsewhere. The one combination every form of the rule ends in."""
    cls = reaches.to(torch.int8)
    return torch.where(covers, torch.full_like(cls, int(TileClass.FULL)), cls)


def _kernel_summary(mask: FlashMask, block: int) -> BlockSummary:
    """The block summary as the kernels read it: a ragged last key block reduced as if its missing
    columns held the canonical empty interval ``(num_rows, -1)``, so ``max_fms = num_rows`` and
    ``min_fme = -1`` there. No tile of it is then FULL (the kernels mask those columns), and it is
    reached exactly as before (an empty interval reaches nothing). Cached on the mask."""
    summary = mask.block_summary(block)
    if mask.num_keys % block == 0:
        return summary

    def make() -> BlockSummary:
        max_fms, min_fme = summary.max_fms.clone(), summary.min_fme.clone()
        max_fms[:, :, -1] = mask.num_rows
        min_fme[:, :, -1] = -1
        return BlockSummary(block=block, num_keys=summary.num_keys, min_fms=summary.min_fms, max_fms=max_fms,
                            min_fme=min_fme, max_fme=summary.max_fme)

    return mask.cached(("kernel_summary", block), make)


def tile_classes(mask: FlashMask, positions: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """The kernels' tile classes: ``[B, Hm, Tr, Tc]`` int8 :class:`TileClass` of each tile of
    ``block_q`` queries (at global rows ``positions`` ``[Nq]``, any order) x ``block_k`` key columns,
    from the column bounds; a ragged last key block is never FULL (module docstring)."""
    lo, hi = row_block_bounds(positions, block_q)
    return classify_tiles(_kernel_summary(mask, block_k), lo, hi)


def consecutive_tile_ranges(mask: FlashMask, row_offset: int, num_rows: int, block_q: int,
                            block_k: int) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """:func:`tile_ranges` as the kernels read them (a ragged last key block never FULL), for the
    consecutive rows ``row_offset .. row_offset + num_rows - 1``: ``(ranges, tq, tk)`` with ranges
    ``(reach_first, reach_last, cover_first, cover_last)``, each ``[B, Hm, T_k, S]`` int64, and the
    numbers of query and key blocks. Read them with :func:`classes_in_ranges`."""
    summary = _kernel_summary(mask, block_k)
    return tile_ranges(summary, row_offset, num_rows, block_q), -(-num_rows // block_q), summary.num_blocks


def classes_in_ranges(ranges, query_blocks: torch.Tensor, tq: int) -> torch.Tensor:
    """Tile classes read from tile ranges: ``[..., T_k, K]`` int8 at the query blocks ``query_blocks``
    ``[..., T_k, K]`` (``K`` points per key block) for ranges ``[..., T_k, S]`` each; -1 outside
    ``[0, tq)``. Equals :func:`classify_tiles` on those tiles (tested)."""
    reach_first, reach_last, cover_first, cover_last = (r.unsqueeze(-2) for r in ranges)
    p = query_blocks.unsqueeze(-1)
    covers = ((cover_first <= p) & (p <= cover_last)).any(-1)
    reaches = ((reach_first <= p) & (p <= reach_last)).any(-1)
    return torch.where((query_blocks < 0) | (query_blocks >= tq), -1, _class_of(covers, reaches))


def tile_ranges(summary: BlockSummary, offset: int, num_rows: int, block: int) -> tuple[torch.Tensor, ...]:
    """The tile rule solved for the query block, when query block ``t`` holds the consecutive rows
    ``offset + t * block ..`` (a whole mask, a ring chunk): per key block and interval slot, the query
    blocks that the slot *reaches* and that it *covers* are each one contiguous range, because a
    block's first and last rows grow with ``t``. Same comparisons as :func:`classify_tiles`:
    ``reaches = min_fms <= hi and max_fme >= lo``, ``covers = max_fms <= lo and min_fme >= hi``.

    Returns ``(reach_first, reach_last, cover_first, cover_last)``, each ``[B, Hm, Tc, M]`` int64,
    inclusive query-block indices (first > last: empty). A tile is FULL when some slot covers it,
    PARTIAL when some slot reaches it and none covers it, else SKIP. O(N / block) work and memory.
    """
    tq = -(-num_rows // block)
    last_row = offset + num_rows - 1
    fms_lo, fms_hi = summary.min_fms.to(torch.int64), summary.max_fms.to(torch.int64)
    fme_lo, fme_hi = summary.min_fme.to(torch.int64), summary.max_fme.to(torch.int64)

    def first_with_hi_at_least(x):  # smallest t with hi(t) = min(offset + t*block + block-1, last_row) >= x
        t = torch.div(x - offset - (block - 1) + block - 1, block, rounding_mode="floor").clamp(min=0)
        return torch.where(x > last_row, torch.full_like(t, tq), t)

    def last_with_lo_at_most(y):  # largest t with lo(t) = offset + t*block <= y
        return torch.div(y - offset, block, rounding_mode="floor").clamp(max=tq - 1)

    def first_with_lo_at_least(x):  # smallest t with lo(t) >= x
        return torch.div(x - offset + block - 1, block, rounding_mode="floor").clamp(min=0)

    def last_with_hi_at_most(z):  # largest t with hi(t) <= z
        t = torch.div(z - offset - (block - 1), block, rounding_mode="floor").clamp(max=tq - 1)
        return torch.where(z >= last_row, torch.full_like(t, tq - 1), t)

    return (first_with_hi_at_least(fms_lo), last_with_lo_at_most(fme_hi),
            first_with_lo_at_least(fms_hi), last_with_hi_at_most(fme_lo))


def row_block_bounds(positions: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_lo, row_hi)``, each ``[Tr]``: min / max global row of each block of ``block`` queries.

    Args:
        positions: ``[Nq]`` global row of each local query (``q_offset + arange(Nq)`` for a slice).
    """
    nq = positions.numel()
    tr = -(-nq // block)
    pad = tr * block - nq
    pos = positions.to(torch.int64)
    lo = torch.cat([pos, pos.new_full((pad,), torch.iinfo(torch.int64).max)]).view(tr, block).amin(1)
    hi = torch.cat([pos, pos.new_full((pad,), -1)]).view(tr, block).amax(1)
    return lo, hi


def count_tiles(mask: FlashMask, block_q: int = 128, block_k: int = 128, rows_per_chunk: int = 1024):
    """``(skipped, partial, full)`` tile counts over rows ``0 .. num_rows-1``, summed over ``[B, Hm]``.

    Query blocks are classified a chunk at a time so memory stays O(N / block) per chunk.
    """
    summary = mask.block_summary(block_k)
    lo, hi = row_block_bounds(torch.arange(mask.num_rows, device=mask.device), block_q)
    counts = torch.zeros(3, dtype=torch.int64, device=mask.device)
    for start in range(0, lo.numel(), rows_per_chunk):
        cls = classify_tiles(summary, lo[start : start + rows_per_chunk], hi[start : start + rows_per_chunk])
        counts += torch.bincount(cls.flatten().to(torch.int64), minlength=3)
    skipped, partial, full = counts.tolist()
    return skipped, partial, full
