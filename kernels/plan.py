"""Block-sparse launch plans: which key blocks each query block visits, from the shared tile rule.

A kernel program owns one block of queries (or, for the dK/dV pass, one block of keys). Its plan is
two lists of *runs* of consecutive blocks, stored CSR-style: the runs whose tiles are fully visible
(no mask math) and the runs whose tiles are partial (masked in registers). Skipped tiles appear in
neither list, so they cost nothing in the kernel, not even a branch. Typical masks give one or two
runs per block, so the plan is O(N / block) integers, built once per mask and block shape.

The classification itself is :func:`fm_parallel.masks.classify_tiles`; this module only lays its
result out for kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fm_parallel.masks.blocks import TileClass, classify_tiles, row_block_bounds
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["BlockSparsePlan", "build_plan", "build_plans"]


@dataclass(frozen=True)
class BlockSparsePlan:
    """Runs of visited blocks per (mask row, outer block), full and partial, CSR layout.

    ``*_offsets``: ``[Bm * Hm * T_outer + 1]`` int32; the runs of outer block ``o`` of mask row
    ``r`` are ``*_runs[offsets[r * T_outer + o] : offsets[r * T_outer + o + 1]]``, each ``[start, end)``
    in inner blocks (``*_runs``: ``[n_runs, 2]`` int32).
    """

    block_m: int
    block_n: int
    transposed: bool  # outer = key blocks (dK/dV pass) instead of query blocks
    num_outer: int
    full_offsets: torch.Tensor
    full_runs: torch.Tensor
    part_offsets: torch.Tensor
    part_runs: torch.Tensor
    order: torch.Tensor  # [T_outer] int32: outer blocks by decreasing work, the launch order

    @property
    def tiles(self) -> tuple[int, int]:
        """(full, partial) tiles visited in total."""
        widths = lambda runs: int((runs[:, 1] - runs[:, 0]).sum()) if runs.numel() else 0  # noqa: E731
        return widths(self.full_runs), widths(self.part_runs)


def _runs(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR runs of True along the last dim of ``flag`` ``[R, T]``."""
    starts = flag & ~F.pad(flag[:, :-1], (1, 0), value=False)
    ends = flag & ~F.pad(flag[:, 1:], (0, 1), value=False)
    offsets = torch.zeros(flag.shape[0] + 1, dtype=torch.int64, device=flag.device)
    offsets[1:] = torch.cumsum(starts.sum(1), 0)
    # nonzero is row-major, so starts and ends pair up run by run.
    runs = torch.stack([torch.nonzero(starts)[:, 1], torch.nonzero(ends)[:, 1] + 1], dim=1)
    return offsets.to(torch.int32), runs.to(torch.int32).contiguous()


def _classes(mask: FlashMask, positions: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """``[Bm * Hm, Tr, Tc]`` tile classes; a ragged last key block is never full (its missing columns
    must be masked)."""
    lo, hi = row_block_bounds(positions, block_m)
    cls = classify_tiles(mask.block_summary(block_n), lo, hi)  # [Bm, Hm, Tr, Tc]
    if mask.num_keys % block_n:
        last = cls[..., -1]
        cls[..., -1] = torch.where(last == TileClass.FULL, torch.full_like(last, int(TileClass.PARTIAL)), last)
    return cls.flatten(0, 1)


def _layout(cls: torch.Tensor, block_m: int, block_n: int, transposed: bool) -> BlockSparsePlan:
    if transposed:
        cls = cls.transpose(1, 2)
    num_outer = cls.shape[1]
    cls = cls.reshape(-1, cls.shape[2])
    full_offsets, full_runs = _runs(cls == TileClass.FULL)
    part_offsets, part_runs = _runs(cls == TileClass.PARTIAL)
    # Programs start in grid order: launching the busiest blocks first keeps a long one (the last
    # rows of a causal mask, rows that see a whole sequence) from running alone at the end.
    work = (cls != TileClass.SKIP).view(-1, num_outer, cls.shape[1]).sum((0, 2))
    order = torch.argsort(work, descending=True, stable=True).to(torch.int32)
    return BlockSparsePlan(block_m, block_n, transposed, num_outer, full_offsets, full_runs, part_offsets, part_runs, order)


def build_plan(
    mask: FlashMask, positions: torch.Tensor, block_m: int, block_n: int, transposed: bool = False
) -> BlockSparsePlan:
    """Plan for queries at ``positions`` ``[Nq]`` against all ``mask.num_keys`` keys
    (outer = query blocks, or key blocks when ``transposed``)."""
    return _layout(_classes(mask, positions, block_m, block_n), block_m, block_n, transposed)


def build_plans(mask: FlashMask, positions: torch.Tensor, block_m: int, block_n: int) -> tuple[BlockSparsePlan, BlockSparsePlan]:
    """Both orientations from one classification: (per query block, per key block)."""
    cls = _classes(mask, positions, block_m, block_n)
    return _layout(cls, block_m, block_n, False), _layout(cls, block_m, block_n, True)
