"""Launch plans (and FA4's block lists) built on the GPU by Triton, for consecutive query rows.

:func:`fm_parallel.kernels.plan.build_plans_consecutive` turns the tile rule's per-key-block ranges
(:func:`fm_parallel.masks.tile_ranges`: for each key block and interval slot, the query blocks the
slot reaches and covers) into CSR lists of runs. Its PyTorch form is a few hundred small operations
with a dozen host syncs (``nonzero``, ``repeat_interleave``): on the H200 that is 5-8 ms whatever N,
all launch and sync overhead. Here the same lists come from two passes of one Triton kernel per
orientation, one program per (mask row, outer block), scanning the inner blocks in chunks:

0. (PyTorch, ~15 operations) per program the span of inner blocks that can be visited at all
   (:func:`_inner_bounds`): a document's width for packed documents, so the scans below do not
   grow with N^2 there (causal masks still scan their whole triangle);
1. count: runs of full and of partial tiles, and the tiles visited (for the launch order);
2. (host) offsets = cumsum of the counts, one sync for the run totals, the arrays allocated;
3. write: the same scan, each run's start and end stored at its slot (``cumsum`` inside the chunk).

A tile's class is read from the ranges as :func:`fm_parallel.masks.blocks.classes_in_ranges` reads
them (FULL if some slot covers the query block, PARTIAL if some slot reaches it): :func:`_class_at`
is that reader on the device (a Triton kernel cannot call PyTorch), with the class values of
:class:`~fm_parallel.masks.blocks.TileClass`; the ranges themselves, and so the tile rule, come
from :mod:`fm_parallel.masks.blocks`. Work: M comparisons per tile of the
programs' spans (at most T_q * T_k), on values held in L2 (the ranges are ``16 * M`` bytes per key
block), no per-tile memory. The result equals the PyTorch builders array for array
(``tests/kernels/test_triton_plan.py``). :func:`lists_from_ranges` writes FA4's dense lists the same
way, one launch per orientation (those lists are O(T_q * T_k) by FA4's format).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fm_parallel.masks.blocks import TileClass

__all__ = ["plans_from_ranges", "lists_from_ranges"]

_CHUNK = 1024  # inner blocks per step of a program (a power of two; 4 warps hold 8 per thread)
# The classes as the kernels compare them (globals a Triton kernel reads must be constexpr).
_FULL = tl.constexpr(int(TileClass.FULL))
_PARTIAL = tl.constexpr(int(TileClass.PARTIAL))
_SKIP = tl.constexpr(int(TileClass.SKIP))


@triton.jit
def _class_at(p_ranges, qb, kb, Tq, Tk, M: tl.constexpr):
    """Tile class (:class:`TileClass` values) of query block ``qb`` x key block ``kb`` (one of them
    a vector), -1 outside the grid. ``p_ranges``: this mask row's ``[4 * M, Tk]`` int32 ranges, field
    ``4 * m + j`` = (reach_first, reach_last, cover_first, cover_last)[j] of slot ``m``."""
    # Both as vectors before comparing (the interpreter mishandles a scalar bool & a vector bool).
    qb, kb = qb + 0 * kb, kb + 0 * qb
    inside = (qb >= 0) & (qb < Tq) & (kb >= 0) & (kb < Tk)
    covers = tl.zeros_like(inside)
    reaches = tl.zeros_like(inside)
    for m in tl.static_range(M):
        reach_first = tl.load(p_ranges + (4 * m + 0) * Tk + kb, mask=inside, other=0)
        reach_last = tl.load(p_ranges + (4 * m + 1) * Tk + kb, mask=inside, other=-1)
        cover_first = tl.load(p_ranges + (4 * m + 2) * Tk + kb, mask=inside, other=0)
        cover_last = tl.load(p_ranges + (4 * m + 3) * Tk + kb, mask=inside, other=-1)
        covers = covers | ((cover_first <= qb) & (qb <= cover_last))
        reaches = reaches | ((reach_first <= qb) & (qb <= reach_last))
    cls = tl.where(covers, _FULL, tl.where(reaches, _PARTIAL, _SKIP))
    return tl.where(inside, cls, -1)


@triton.jit
def _program(Tq, Tk, TRANSPOSED: tl.constexpr):
    """This program's ``(outer block o, mask row r, T_outer, T_inner, CSR row r * T_outer + o)``."""
    o = tl.program_id(0)
    r = tl.program_id(1)
    if TRANSPOSED:
        t_outer = Tk
        t_inner = Tq
    else:
        t_outer = Tq
        t_inner = Tk
    return o, r, t_outer, t_inner, r * t_outer + o


@triton.jit
def _inner_class(p_row, o, i, Tq, Tk, M: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Classes of outer block ``o`` x inner blocks ``i`` (key blocks, or query blocks when TRANSPOSED)."""
    if TRANSPOSED:
        cls = _class_at(p_row, i, o, Tq, Tk, M)
    else:
        cls = _class_at(p_row, o, i, Tq, Tk, M)
    return cls


@triton.jit
def _plan_kernel(
    p_ranges, p_bounds, p_counts, p_work, p_full_offsets, p_full_runs, p_part_offsets, p_part_runs,
    Tq, Tk, R,
    M: tl.constexpr, TRANSPOSED: tl.constexpr, WRITE: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program per (outer block ``o``, mask row ``r``). Not TRANSPOSED: outer = query blocks,
    inner = key blocks (forward and dQ plans); TRANSPOSED: the dK/dV plan.

    Count pass (not WRITE): ``counts[0 | 1, r * T_outer + o]`` = runs of full | partial tiles,
    ``work[r, o]`` = tiles visited. Write pass: runs ``[start, end)`` at ``offsets[r * T_outer + o]``
    onwards. Runs are found as (class here) != (class one inner block before / after).
    ``bounds[0 | 1, r * T_outer + o]``: first / last inner block that may be visited (see
    :func:`_inner_bounds`); the scan covers only those."""
    o, r, t_outer, t_inner, row = _program(Tq, Tk, TRANSPOSED)
    p_row = p_ranges + r * (4 * M) * Tk
    if WRITE:
        full_start = tl.load(p_full_offsets + row)
        full_end = full_start
        part_start = tl.load(p_part_offsets + row)
        part_end = part_start
    else:
        full_start = 0
        full_end = 0
        part_start = 0
        part_end = 0
    work = 0
    lo = tl.load(p_bounds + row)
    hi = tl.load(p_bounds + R * t_outer + row)
    for first in range(lo, hi + 1, CHUNK):
        i = first + tl.arange(0, CHUNK)
        here = _inner_class(p_row, o, i, Tq, Tk, M, TRANSPOSED)
        before = _inner_class(p_row, o, i - 1, Tq, Tk, M, TRANSPOSED)
        after = _inner_class(p_row, o, i + 1, Tq, Tk, M, TRANSPOSED)
        work += tl.sum((here > 0).to(tl.int32), 0)
        full_s = ((here == _FULL) & (before != _FULL)).to(tl.int32)
        full_e = ((here == _FULL) & (after != _FULL)).to(tl.int32)
        part_s = ((here == _PARTIAL) & (before != _PARTIAL)).to(tl.int32)
        part_e = ((here == _PARTIAL) & (after != _PARTIAL)).to(tl.int32)
        if WRITE:
            # k-th start and k-th end of a (row, class) belong to the same run: runs are disjoint
            # and ordered, so separate running slots for starts and ends pair them up across chunks.
            tl.store(p_full_runs + 2 * (full_start + tl.cumsum(full_s, 0) - 1), i, mask=full_s > 0)
            tl.store(p_full_runs + 2 * (full_end + tl.cumsum(full_e, 0) - 1) + 1, i + 1, mask=full_e > 0)
            tl.store(p_part_runs + 2 * (part_start + tl.cumsum(part_s, 0) - 1), i, mask=part_s > 0)
            tl.store(p_part_runs + 2 * (part_end + tl.cumsum(part_e, 0) - 1) + 1, i + 1, mask=part_e > 0)
        full_start += tl.sum(full_s, 0)
        full_end += tl.sum(full_e, 0)
        part_start += tl.sum(part_s, 0)
        part_end += tl.sum(part_e, 0)
    if not WRITE:
        tl.store(p_counts + row, full_start)
        tl.store(p_counts + R * t_outer + row, part_start)
        tl.store(p_work + row, work)


def _inner_bounds(ranges: torch.Tensor, tq: int, transposed: bool) -> torch.Tensor:
    """``[2, R * T_outer]`` int32: per (mask row, outer block) the first and last inner block that some
    interval slot *reaches* (every visited tile lies between; lo > hi: none), so a program scans that
    span instead of every inner block. Conservative, hence exact plans: a block outside is skipped.

    Key block kb reaches the query blocks ``[reach_first, reach_last]`` of each non-empty slot. Per key
    block (the dK/dV plan) that is min / max over the slots. Per query block qb (the forward plan):
    last = the largest kb whose reach starts at or before qb (a running max over qb), first = the
    smallest kb whose reach ends at or after qb (a running min from the end)."""
    num_rows, fields, tk = ranges.shape
    first, last = ranges[:, 0::4, :].long(), ranges[:, 1::4, :].long()  # [R, M, T_k]
    live = first <= last
    if transposed:
        lo = torch.where(live, first, tq).amin(1)
        hi = torch.where(live, last, -1).amax(1)
        return torch.stack([lo, hi]).reshape(2, -1).to(torch.int32)
    kb = torch.arange(tk, device=ranges.device).expand_as(first)
    dump = torch.full_like(first, tq)  # dead slots go to a spare column
    hi = torch.full((num_rows, tq + 1), -1, dtype=torch.int64, device=ranges.device)
    hi.scatter_reduce_(1, torch.where(live, first, dump).flatten(1), kb.flatten(1), "amax")
    lo = torch.full((num_rows, tq + 1), tk, dtype=torch.int64, device=ranges.device)
    lo.scatter_reduce_(1, torch.where(live, last, dump).flatten(1), kb.flatten(1), "amin")
    hi = hi[:, :tq].cummax(1).values
    lo = lo[:, :tq].flip(1).cummin(1).values.flip(1)
    return torch.stack([lo, hi]).reshape(2, -1).to(torch.int32)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(counts.shape[0], counts.shape[1] + 1, dtype=torch.int32, device=counts.device)
    offsets[:, 1:] = torch.cumsum(counts, dim=1)
    return offsets


def plans_from_ranges(ranges: torch.Tensor, tq: int, block_m: int, block_n: int):
    """The arrays of the (forward, transposed) :class:`~fm_parallel.kernels.plan.BlockSparsePlan` of
    consecutive query rows from their tile ranges: per orientation ``(full_offsets, full_runs,
    part_offsets, part_runs, work)``, ``work`` ``[T_outer]`` the tiles each outer block visits summed
    over the mask rows; :func:`fm_parallel.kernels.plan.build_plans_consecutive` lays them out (and
    orders them), so this module needs nothing from that one.

    Args:
        ranges: ``[R, 4 * M, T_k]`` int32 (R mask rows = ``Bm * Hm``), field ``4 * m + j`` of slot
            ``m`` = (reach_first, reach_last, cover_first, cover_last)[j], inclusive query blocks,
            the ragged-last-key-block rule already applied (its cover range empty).
        tq: number of query blocks.
        block_m, block_n: the tile shape the ranges were made for (the scan itself needs only the ranges).
    """
    if ranges.dim() != 3 or ranges.shape[1] % 4 or ranges.dtype != torch.int32:
        raise ValueError(f"ranges: expected [R, 4 * M, T_k] int32, got {list(ranges.shape)} {ranges.dtype}")
    num_rows, fields, tk = ranges.shape
    ranges = ranges.contiguous()
    device = ranges.device
    counts, works, bounds = [], [], []
    for transposed in (False, True):
        outer = tk if transposed else tq
        count = torch.empty(2, num_rows * outer, dtype=torch.int32, device=device)
        work = torch.empty(num_rows, outer, dtype=torch.int32, device=device)
        bounds.append(_inner_bounds(ranges, tq, transposed) if outer else None)
        if outer:
            _plan_kernel[(outer, num_rows)](ranges, bounds[-1], count, work, None, None, None, None, tq, tk, num_rows,
                                            M=fields // 4, TRANSPOSED=transposed, WRITE=False, CHUNK=_CHUNK)
        counts.append(count)
        works.append(work)
    offsets = [_offsets(c) for c in counts]  # [2, R * T_outer + 1] each: full, partial
    totals = torch.stack([o[:, -1] for o in offsets]).tolist()  # the one host sync: array sizes
    out = []
    for transposed, offs, (n_full, n_part), work, bound in zip((False, True), offsets, totals, works, bounds):
        outer = tk if transposed else tq
        full_runs = torch.empty(n_full, 2, dtype=torch.int32, device=device)
        part_runs = torch.empty(n_part, 2, dtype=torch.int32, device=device)
        if outer and (n_full or n_part):
            _plan_kernel[(outer, num_rows)](ranges, bound, None, None, offs[0], full_runs, offs[1], part_runs, tq, tk, num_rows,
                                            M=fields // 4, TRANSPOSED=transposed, WRITE=True, CHUNK=_CHUNK)
        out.append((offs[0].contiguous(), full_runs, offs[1].contiguous(), part_runs, work.sum(0)))
    return out[0], out[1]


@triton.jit
def _lists_kernel(p_ranges, p_full_cnt, p_full_idx, p_part_cnt, p_part_idx, Tq, Tk,
                  M: tl.constexpr, TRANSPOSED: tl.constexpr, CHUNK: tl.constexpr):
    """FA4's dense block lists, one program per (outer block ``o``, mask row ``r``): the ascending
    indices of the full and of the partial inner blocks, zeros past the count, and the counts."""
    o, r, t_outer, t_inner, row = _program(Tq, Tk, TRANSPOSED)
    p_row = p_ranges + r * (4 * M) * Tk
    p_full = p_full_idx + row.to(tl.int64) * t_inner
    p_part = p_part_idx + row.to(tl.int64) * t_inner
    n_full = 0
    n_part = 0
    for first in range(0, t_inner, CHUNK):
        i = first + tl.arange(0, CHUNK)
        cls = _inner_class(p_row, o, i, Tq, Tk, M, TRANSPOSED)
        is_full = (cls == _FULL).to(tl.int32)
        is_part = (cls == _PARTIAL).to(tl.int32)
        tl.store(p_full + n_full + tl.cumsum(is_full, 0) - 1, i, mask=is_full > 0)
        tl.store(p_part + n_part + tl.cumsum(is_part, 0) - 1, i, mask=is_part > 0)
        n_full += tl.sum(is_full, 0)
        n_part += tl.sum(is_part, 0)
    for first in range(0, t_inner, CHUNK):  # the tails: zeros past the counts
        i = first + tl.arange(0, CHUNK)
        tl.store(p_full + i, tl.zeros_like(i), mask=(i >= n_full) & (i < t_inner))
        tl.store(p_part + i, tl.zeros_like(i), mask=(i >= n_part) & (i < t_inner))
    tl.store(p_full_cnt + row, n_full)
    tl.store(p_part_cnt + row, n_part)


def lists_from_ranges(ranges: torch.Tensor, tq: int, transposed: bool):
    """FA4's block lists of one orientation from the tile ranges (see :func:`plans_from_ranges` for
    ``ranges``): ``(full_cnt, full_idx, part_cnt, part_idx)``, counts ``[R, T_outer]`` and indices
    ``[R, T_outer, T_inner]`` int32, one kernel launch, no host sync."""
    if ranges.dim() != 3 or ranges.shape[1] % 4 or ranges.dtype != torch.int32:
        raise ValueError(f"ranges: expected [R, 4 * M, T_k] int32, got {list(ranges.shape)} {ranges.dtype}")
    num_rows, fields, tk = ranges.shape
    outer, inner = (tk, tq) if transposed else (tq, tk)
    ranges = ranges.contiguous()
    full_cnt, part_cnt = (torch.empty(num_rows, outer, dtype=torch.int32, device=ranges.device) for _ in range(2))
    full_idx, part_idx = (torch.empty(num_rows, outer, inner, dtype=torch.int32, device=ranges.device) for _ in range(2))
    if outer and inner:
        _lists_kernel[(outer, num_rows)](ranges, full_cnt, full_idx, part_cnt, part_idx, tq, tk,
                                         M=fields // 4, TRANSPOSED=transposed, CHUNK=_CHUNK)
    return full_cnt, full_idx, part_cnt, part_idx
