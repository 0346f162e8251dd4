"""Vectorised algebra on per-column sets of row intervals.

A set of intervals is a pair of integer tensors ``starts``, ``ends`` of shape ``[..., M]``: interval
``m`` of a column covers the inclusive rows ``starts[..., m] <= i <= ends[..., m]``, and is empty when
``starts > ends``. Every function here works on all columns at once (no Python loop over tokens);
the only loop-like dimension is ``M``, which is at most a handful of intervals.

The *normal form* produced by :func:`normalize` is what :class:`~fm_parallel.masks.FlashMask` stores:
non-empty intervals first, sorted by start, pairwise disjoint and non-adjacent (touching intervals are
merged), clipped to ``[0, num_rows - 1]``; empty slots are ``(num_rows, -1)``.
"""

from __future__ import annotations

import torch

__all__ = ["MaskNotExpressible", "normalize", "union", "intersect", "complement", "count_rows"]


class MaskNotExpressible(ValueError):
    """A mask needs more row intervals in some key column than the representation allows.

    Attributes:
        column: the first offending key column.
        needed: how many intervals that column needs.
        limit: how many were allowed.
    """

    def __init__(self, column: int | None, needed: int | None, limit: int | None, what: str = "mask", reason: str = ""):
        self.column, self.needed, self.limit = column, needed, limit
        if not reason:
            reason = f"key column {column} needs {needed} row intervals, at most {limit} are allowed"
        super().__init__(f"{what} is not expressible as a FlashMask: {reason}")


def normalize(
    starts: torch.Tensor,
    ends: torch.Tensor,
    num_rows: int,
    max_intervals: int | None = 4,
    min_intervals: int = 1,
    what: str = "mask",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort, clip and merge the intervals of every column into the normal form.

    Args:
        starts, ends: ``[..., K]`` integer tensors, any order, overlaps and empties allowed.
        num_rows: rows are clipped to ``[0, num_rows - 1]``.
        max_intervals: raise :class:`MaskNotExpressible` when a column needs more (None: no limit).
        min_intervals: the output has at least this many slots (padded with empties).
    Returns:
        ``starts, ends`` of shape ``[..., M]`` int32, ``M = max(min_intervals, most intervals any column needs)``.
    """
    s = starts.to(torch.int64).clamp(min=0)
    e = ends.to(torch.int64).clamp(max=num_rows - 1)
    empty = s > e
    # Empties sort last; their start is beyond every real row.
    s = torch.where(empty, torch.full_like(s, num_rows + 1), s)
    s, order = torch.sort(s, dim=-1, stable=True)
    e = torch.gather(e, -1, order)
    empty = torch.gather(empty, -1, order)
    e = torch.where(empty, torch.full_like(e, -2), e)

    # An interval opens a new group unless it overlaps or touches the running maximum end.
    run_end = torch.cummax(e, dim=-1).values
    prev_end = torch.cat([torch.full_like(run_end[..., :1], -2), run_end[..., :-1]], dim=-1)
    opens = (~empty) & (s > prev_end + 1)
    group = torch.cumsum(opens.to(torch.int64), dim=-1) - 1
    counts = opens.sum(dim=-1)
    most = int(counts.max()) if counts.numel() else 0
    if max_intervals is not None and most > max_intervals:
        first = int(torch.nonzero((counts > max_intervals).reshape(-1))[0])
        column = first % counts.shape[-1] if counts.dim() else 0
        raise MaskNotExpressible(column, most, max_intervals, what)
    slots = max(most, min_intervals)
    # Empties go to a scratch slot that is dropped afterwards.
    group = torch.where(empty, torch.full_like(group, slots), group)
    shape = (*s.shape[:-1], slots + 1)
    out_s = torch.full(shape, num_rows, dtype=torch.int64, device=s.device)
    out_e = torch.full(shape, -1, dtype=torch.int64, device=s.device)
    out_s.scatter_reduce_(-1, group, s, reduce="amin", include_self=True)
    out_e.scatter_reduce_(-1, group, e, reduce="amax", include_self=True)
    out_s, out_e = out_s[..., :slots], out_e[..., :slots]
    unused = out_s > out_e
    out_s = torch.where(unused, torch.full_like(out_s, num_rows), out_s)
    out_e = torch.where(unused, torch.full_like(out_e, -1), out_e)
    return out_s.to(torch.int32), out_e.to(torch.int32)


def union(a, b, num_rows: int, max_intervals: int | None = 4, what: str = "union"):
    """Union of two interval sets ``(starts, ends)`` that broadcast against each other."""
    (sa, ea), (sb, eb) = a, b
    shape = torch.broadcast_shapes(sa.shape[:-1], sb.shape[:-1])
    s = torch.cat([sa.expand(*shape, sa.shape[-1]), sb.expand(*shape, sb.shape[-1])], dim=-1)
    e = torch.cat([ea.expand(*shape, ea.shape[-1]), eb.expand(*shape, eb.shape[-1])], dim=-1)
    return normalize(s, e, num_rows, max_intervals, what=what)


def intersect(a, b, num_rows: int, max_intervals: int | None = 4, what: str = "intersection"):
    """Intersection of two interval sets; pairwise intersections of disjoint sets are disjoint."""
    (sa, ea), (sb, eb) = a, b
    s = torch.maximum(sa.unsqueeze(-1).to(torch.int64), sb.unsqueeze(-2).to(torch.int64))
    e = torch.minimum(ea.unsqueeze(-1).to(torch.int64), eb.unsqueeze(-2).to(torch.int64))
    return normalize(s.flatten(-2), e.flatten(-2), num_rows, max_intervals, what=what)


def complement(starts, ends, num_rows: int, max_intervals: int | None = None, what: str = "complement"):
    """Rows of ``[0, num_rows - 1]`` not covered by the intervals."""
    s, e = normalize(starts, ends, num_rows, None)
    s, e = s.to(torch.int64), e.to(torch.int64)
    empty = s > e
    # Empty slots become (num_rows, num_rows - 1) so that they add no spurious gap.
    s = torch.where(empty, torch.full_like(s, num_rows), s)
    e = torch.where(empty, torch.full_like(e, num_rows - 1), e)
    gap_s = torch.cat([torch.zeros_like(s[..., :1]), e + 1], dim=-1)
    gap_e = torch.cat([s - 1, torch.full_like(e[..., :1], num_rows - 1)], dim=-1)
    return normalize(gap_s, gap_e, num_rows, max_intervals, what=what)


def count_rows(starts: torch.Tensor, ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Number of rows covered per column, ``[...]`` int64 (intervals assumed disjoint)."""
    s = starts.to(torch.int64).clamp(min=0)
    e = ends.to(torch.int64).clamp(max=num_rows - 1)
    return (e - s + 1).clamp(min=0).sum(dim=-1)
