"""Block-sparse launch plans: which key blocks each query block visits, from the shared tile rule.

A kernel program owns one block of queries (or, for the dK/dV pass, one block of keys). Its plan is
two lists of *runs* of consecutive blocks, stored CSR-style: the runs whose tiles are fully visible
(no mask math) and the runs whose tiles are partial (masked in registers). Skipped tiles appear in
neither list, so they cost nothing in the kernel, not even a branch. Typical masks give one or two
runs per block, so the plan is O(N / block) integers, built once per mask and block shape.

The classification itself is :mod:`fm_parallel.masks.blocks` (:func:`~fm_parallel.masks.blocks.tile_classes`
for any rows, :func:`~fm_parallel.masks.blocks.consecutive_tile_ranges` and
:func:`~fm_parallel.masks.blocks.classes_in_ranges` for consecutive rows); this module only lays its
result out for kernels. The Triton builder (:mod:`fm_parallel.kernels.triton.plan`) returns the same arrays, which
:func:`build_plans_consecutive` lays out here (that module imports nothing from this one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fm_parallel.masks.blocks import TileClass, classes_in_ranges, consecutive_tile_ranges, tile_classes
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["BlockSparsePlan", "build_plan", "build_plans", "build_plans_consecutive", "consecutive_ranges", "packed_ranges"]


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
    order: torch.Tensor  # [T_outer + ORDER_BUCKETS + 1] int32: the launch order (launch_order)

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


# Cost buckets of the launch order (powers of two of the tiles a block visits): 2^24 tiles is far past
# any sequence a GPU holds. The kernels' decoders loop over them (triton.kernels._program_ids,
# fa4.cost_schedule.CostOrderScheduler).
ORDER_BUCKETS = 24


def launch_order(work: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """The order in which a pass's programs (Triton) or CTAs (FA4) run, heaviest first: int32
    ``[T + ORDER_BUCKETS + 1]`` from ``work [T]``, the tiles each outer block visits summed over the
    plan's ``rows`` mask rows (batch x heads).

    The outer blocks go in buckets by the tiles they visit per row (bucket ``floor(log2(tiles))``),
    the heaviest bucket first; within a bucket the kernel runs every (batch, head) entry in turn, each
    over the bucket's blocks heaviest first (ties in block order). So heavy blocks (global rows,
    attention sinks, the last rows of causal-like masks) start early and cannot leave the GPU waiting
    at the end (one block per head in grid order can start at 15/16 of the kernel), while the
    programs in flight stay within one or two heads, whose K / V (forward) or Q / dO (backward) the
    L2 then holds. Layout: ``[:T]`` the blocks in launch order; ``[T + r]`` where bucket rank ``r``
    starts in it (rank 0 the heaviest bucket; ``[T + ORDER_BUCKETS] = T``). :func:`launch_items`
    decodes it as the kernels do."""
    per_row = work.double() / max(rows, 1)
    bucket = torch.floor(torch.log2(per_row.clamp_min(1))).long().clamp_max(ORDER_BUCKETS - 1)
    rank = (ORDER_BUCKETS - 1) - bucket
    # one sort, rank ascending then work descending (work < 2^40 tiles; no max taken: no device sync)
    span = 1 << 40
    order = torch.argsort(rank * span + (span - 1 - work.long()), stable=True)
    # where each rank starts in the order (its ranks ascend; searchsorted, not bincount: deterministic on CUDA)
    starts = torch.searchsorted(rank[order], torch.arange(ORDER_BUCKETS + 1, device=work.device))
    return torch.cat([order, starts]).to(torch.int32)


def launch_items(order: torch.Tensor, entries: int, num_block: int | None = None,
                 rep: int = 1) -> list[tuple[int, int]]:
    """(kernel block, batch x head entry) run by each program / CTA in launch order, or (-1, -1) for
    one with no work: :func:`launch_order` decoded as the kernels decode it, in Python (tests, the
    schedule model). ``entries``: the kernel's batch x heads; ``rep``: kernel blocks per outer block
    (FA4's forward under PackGQA or 64-row tiles); ``num_block``: the kernel's blocks per entry."""
    order = order.tolist()
    blocks = len(order) - ORDER_BUCKETS - 1
    num_block = blocks * rep if num_block is None else num_block
    starts = order[blocks:]
    group = entries * rep
    out = []
    for cta in range(blocks * group):
        k = max(j for j in range(ORDER_BUCKETS) if cta >= starts[j] * group)
        first, width = starts[k], starts[k + 1] - starts[k]
        entry, rest = divmod(cta - first * group, width * rep)
        r, sub = divmod(rest, rep)
        block = order[first + r] * rep + sub
        out.append((block, entry) if block < num_block else (-1, -1))
    return out


def _layout(cls: torch.Tensor, block_m: int, block_n: int, transposed: bool) -> BlockSparsePlan:
    if transposed:
        cls = cls.transpose(1, 2)
    num_outer = cls.shape[1]
    cls = cls.reshape(-1, cls.shape[2])
    full_offsets, full_runs = _runs(cls == TileClass.FULL)
    part_offsets, part_runs = _runs(cls == TileClass.PARTIAL)
    # Heaviest blocks first, bucket by bucket (launch_order): a long one (the last rows of a causal
    # mask, rows that see a whole sequence, the key block of attention sinks) never runs alone at the end.
    visited = (cls != TileClass.SKIP).view(-1, num_outer, cls.shape[1])
    order = launch_order(visited.sum((0, 2)), visited.shape[0])
    return BlockSparsePlan(block_m, block_n, transposed, num_outer, full_offsets, full_runs, part_offsets, part_runs, order)


def build_plan(
    mask: FlashMask, positions: torch.Tensor, block_m: int, block_n: int, transposed: bool = False
) -> BlockSparsePlan:
    """Plan for queries at ``positions`` ``[Nq]`` against all ``mask.num_keys`` keys
    (outer = query blocks, or key blocks when ``transposed``)."""
    return _layout(tile_classes(mask, positions, block_m, block_n).flatten(0, 1), block_m, block_n, transposed)


def build_plans(mask: FlashMask, positions: torch.Tensor, block_m: int, block_n: int) -> tuple[BlockSparsePlan, BlockSparsePlan]:
    """Both orientations from one classification: (per query block, per key block)."""
    cls = tile_classes(mask, positions, block_m, block_n).flatten(0, 1)  # [Bm * Hm, T_q, T_k]
    return _layout(cls, block_m, block_n, False), _layout(cls, block_m, block_n, True)


# ----------------------------------------------------------------------------------------------
# Plans without the dense tile grid, for consecutive query rows (a whole mask or a ring chunk).
#
# The dense path classifies all T_q x T_k tiles: O((N / block)^2), 67 M tiles at 512k. When the
# query rows are consecutive, `tile_ranges` gives, per key block and interval slot, the query blocks
# the slot reaches and covers as ranges, so a tile's class changes along the query blocks only at
# those range ends ("breakpoints"). Run ends are found among the breakpoints, and the per-query-block
# plan is the transpose of that, built from the pieces between the breakpoints of neighbouring key
# blocks. Work and memory: O(T_k * M^2 + runs). The result equals `build_plans` exactly (tested).
# ----------------------------------------------------------------------------------------------


def _breakpoints(ranges, tq: int) -> torch.Tensor:
    """Sorted candidate class changes along the query blocks, ``[R, T_k, 4M + 1]`` (with 0)."""
    reach_first, reach_last, cover_first, cover_last = ranges
    zero = torch.zeros_like(reach_first[..., :1])
    points = torch.cat([zero, reach_first, reach_last + 1, cover_first, cover_last + 1], dim=-1).clamp(0, tq)
    return points.sort(dim=-1).values


def _offsets(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64, device=rows.device)
    offsets[1:] = torch.cumsum(torch.bincount(rows, minlength=num_rows), 0)
    return offsets.to(torch.int32)


_CLASSES = (int(TileClass.FULL), int(TileClass.PARTIAL))


def _per_key_block(ranges, tq: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Transposed-plan runs over query blocks, per class (FULL, PARTIAL):
    ``(rows r * T_k + kb, starts, ends)``. Breakpoints and classes are computed once for both."""
    points = _breakpoints(ranges, tq)
    first = torch.ones_like(points, dtype=torch.bool)
    first[..., 1:] = points[..., 1:] != points[..., :-1]  # a repeated breakpoint counts once
    here, before = classes_in_ranges(ranges, points, tq), classes_in_ranges(ranges, points - 1, tq)
    tk = points.shape[1]
    out = []
    for cls_value in _CLASSES:
        starts = first & (here == cls_value) & (before != cls_value)
        ends = first & (before == cls_value) & (here != cls_value)
        r, kb, i = torch.nonzero(starts, as_tuple=True)  # row-major: sorted by (r, kb, point)
        re_, kbe, ie = torch.nonzero(ends, as_tuple=True)
        out.append((r * tk + kb, points[r, kb, i], points[re_, kbe, ie]))
    return out


def _shift(ranges, step: int, tq: int):
    """The ranges of key block kb + step at position kb (empty past either end)."""
    out = []
    for i, x in enumerate(ranges):
        fill = tq if i % 2 == 0 else -1  # firsts empty at tq, lasts at -1
        pad = torch.full_like(x[:, :1], fill)
        out.append(torch.cat([x[:, 1:], pad], 1) if step > 0 else torch.cat([pad, x[:, :-1]], 1))
    return out


def _per_query_block(ranges, tq: int, tk: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Forward-plan runs over key blocks, per class (FULL, PARTIAL): ``(rows r * T_q + qb, starts, ends)``.

    A run starts at (qb, kb) where kb has the class and kb - 1 does not; the query blocks where that
    holds are pieces between the breakpoints of kb and kb - 1 (likewise for run ends with kb + 1).
    The pieces and their classes do not depend on the class asked for: computed once per neighbour.
    """
    own = _breakpoints(ranges, tq)

    def pieces(other):
        points = torch.cat([own, _breakpoints(other, tq)], dim=-1).sort(dim=-1).values
        nxt = torch.cat([points[..., 1:], torch.full_like(points[..., :1], tq)], dim=-1)
        return points, nxt, classes_in_ranges(ranges, points, tq), classes_in_ranges(other, points, tq)

    def entries(piece_set, cls_value):
        points, nxt, here, there = piece_set
        r, kb, i = torch.nonzero((here == cls_value) & (there != cls_value) & (nxt > points), as_tuple=True)
        lo, length = points[r, kb, i], (nxt - points)[r, kb, i]
        # Expand each piece [lo, lo + length) into its query blocks.
        piece = torch.repeat_interleave(torch.arange(length.numel(), device=length.device), length)
        start_of_piece = torch.cumsum(length, 0) - length
        qb = lo[piece] + (torch.arange(piece.numel(), device=piece.device) - start_of_piece[piece])
        return r[piece] * tq + qb, kb[piece]

    before, after = pieces(_shift(ranges, -1, tq)), pieces(_shift(ranges, +1, tq))
    out = []
    for cls_value in _CLASSES:
        row_s, kb_s = entries(before, cls_value)
        row_e, kb_e = entries(after, cls_value)
        # Runs in one (row, query block) are disjoint and ordered: sorted starts and ends pair up.
        order_s = torch.argsort(row_s * (tk + 1) + kb_s)
        order_e = torch.argsort(row_e * (tk + 1) + kb_e)
        out.append((row_s[order_s], kb_s[order_s], kb_e[order_e] + 1))
    return out


# The Triton builder scans every (query block, key block) pair; the PyTorch one is O(T_k) operations
# of fixed count. H200, packed docs, 64 x 64 blocks (docs/benchmarks/README.md): Triton 2.8 vs 6.1 ms
# at 512k (8192^2 tiles), 8.6 vs 5.9 ms at 1M (16384^2): the crossing lies between.
_TRITON_MAX_TILES = 8192 * 8192 * 2


def consecutive_ranges(mask: FlashMask, row_offset: int, num_rows: int, block_m: int, block_n: int):
    """``(ranges, tq, tk)``: :func:`fm_parallel.masks.blocks.consecutive_tile_ranges` with the mask
    rows flattened (``[R, T_k, M]`` x 4, the ragged last key block never FULL)."""
    ranges, tq, tk = consecutive_tile_ranges(mask, row_offset, num_rows, block_m, block_n)
    return [x.flatten(0, 1) for x in ranges], tq, tk


def packed_ranges(ranges) -> torch.Tensor:
    """``[R, T_k, M]`` x 4 -> ``[R, 4 * M, T_k]`` int32, each field contiguous along the key blocks
    (the layout of :mod:`fm_parallel.kernels.triton.plan`)."""
    r, tk = ranges[0].shape[:2]
    return torch.stack(ranges, dim=-1).permute(0, 2, 3, 1).reshape(r, -1, tk).to(torch.int32)


def build_plans_consecutive(mask: FlashMask, row_offset: int, num_rows: int, block_m: int,
                            block_n: int, builder: str = "auto") -> tuple[BlockSparsePlan, BlockSparsePlan]:
    """``build_plans`` for the consecutive query rows ``row_offset .. row_offset + num_rows - 1``,
    without classifying every tile (see the section comment). Same result, O(N / block) work.

    ``builder``: ``"torch"`` (the operations below), ``"triton"`` (:mod:`fm_parallel.kernels.triton.plan`: four kernel
    launches and one sync, what a GPU wants), or ``"auto"``: Triton for a mask on CUDA up to
    ``_TRITON_MAX_TILES`` tiles per mask row, PyTorch beyond."""
    if builder not in ("auto", "torch", "triton"):
        raise ValueError(f"builder: expected 'auto', 'torch' or 'triton', got {builder!r}")
    ranges, tq, tk = consecutive_ranges(mask, row_offset, num_rows, block_m, block_n)
    if builder == "triton" or (builder == "auto" and mask.device.type == "cuda" and tq * tk <= _TRITON_MAX_TILES):
        from fm_parallel.kernels.triton.plan import plans_from_ranges

        arrays = plans_from_ranges(packed_ranges(ranges), tq, block_m, block_n)
    else:
        arrays = (_runs_from_ranges(ranges, tq, tk, False), _runs_from_ranges(ranges, tq, tk, True))
    rows_total = ranges[0].shape[0]
    plans = [BlockSparsePlan(block_m, block_n, transposed, tk if transposed else tq, *runs, launch_order(work, rows_total))
             for transposed, (*runs, work) in zip((False, True), arrays)]
    return plans[0], plans[1]


def _runs_from_ranges(ranges, tq: int, tk: int, transposed: bool):
    """One orientation's ``(full_offsets, full_runs, part_offsets, part_runs, work)`` from the tile
    ranges in PyTorch (``work`` ``[T_outer]``: tiles visited per outer block, summed over mask rows)."""
    rows_total = ranges[0].shape[0]
    outer = tk if transposed else tq
    parts, work = [], torch.zeros(outer, dtype=torch.int64, device=ranges[0].device)
    for row, start, end in (_per_key_block(ranges, tq) if transposed else _per_query_block(ranges, tq, tk)):
        parts.append((_offsets(row, rows_total * outer), torch.stack([start, end], 1).to(torch.int32).contiguous()))
        work.index_add_(0, row % outer, end - start)
    return parts[0][0], parts[0][1], parts[1][0], parts[1][1], work
