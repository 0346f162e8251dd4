"""Head bookkeeping for grouped-query attention and per-head masks, without copying K/V.

Queries ``[B, Hq, N, D]`` are viewed as ``[B, Hkv, G, N, D]`` (``G = Hq / Hkv``) so that every
query head group meets its single K/V head by broadcasting. A mask with ``Hm`` heads
(``1``, ``Hkv`` or ``Hq``) is viewed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["group_queries", "mask_heads_as_groups", "MaskGroup", "mask_groups"]


def group_queries(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``[B, Hq, N, D]`` -> ``[B, Hkv, G, N, D]`` (a view)."""
    b, hq, n, d = q.shape
    return q.view(b, h_kv, hq // h_kv, n, d)


def mask_heads_as_groups(x: torch.Tensor, h_q: int, h_kv: int) -> torch.Tensor:
    """A per-mask-head tensor ``[Bm, Hm, ...]`` viewed as ``[Bm, Hkv | 1, G | 1, ...]``."""
    bm, hm = x.shape[:2]
    rest = x.shape[2:]
    if hm == 1:
        return x.view(bm, 1, 1, *rest)
    if hm == h_kv:
        return x.view(bm, h_kv, 1, *rest)
    return x.view(bm, h_kv, h_q // h_kv, *rest)


@dataclass(frozen=True)
class MaskGroup:
    """Query heads that share one mask row: index ``q5[batch, kv, group]`` of the ``[B, Hkv, G, N, D]`` view."""

    batch: slice
    kv: slice
    group: slice
    mask_b: int
    mask_h: int


def mask_groups(b: int, h_q: int, h_kv: int, mask_b: int, mask_h: int) -> list[MaskGroup]:
    """Partition (batch, heads) into groups that read the same mask row, as few as the mask allows."""
    g = h_q // h_kv
    batches = [(slice(None), 0)] if mask_b == 1 else [(slice(i, i + 1), i) for i in range(b)]
    if mask_h == 1:
        heads = [(slice(None), slice(None), 0)]
    elif mask_h == h_kv:
        heads = [(slice(h, h + 1), slice(None), h) for h in range(h_kv)]
    else:
        heads = [(slice(h // g, h // g + 1), slice(h % g, h % g + 1), h) for h in range(h_q)]
    return [MaskGroup(bs, kv, gs, mb, mh) for bs, mb in batches for kv, gs, mh in heads]
