"""Chunked dense attention: the fallback for masks FlashMask cannot express, and ``impl="dense"``.

Plain PyTorch (float32 arithmetic for half inputs, like SDPA's CPU kernels), over chunks of query rows so that at most ``chunk x Nk`` scores exist at once. Each chunk is checkpointed, so the
backward also stays at O(chunk x Nk) memory instead of keeping every chunk's probabilities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from fm_parallel.heads import group_queries, mask_heads_as_groups

__all__ = ["dense_attention", "attention"]

MaskRows = Callable[[int, int], torch.Tensor]


def _chunk(q_c, k, v, mask_c, scale):
    b, hq, c, _ = q_c.shape
    hkv = k.shape[1]
    cdt = torch.float64 if q_c.dtype == torch.float64 else torch.float32
    s = torch.matmul(group_queries(q_c.to(cdt), hkv).flatten(2, 3), k.to(cdt).transpose(-1, -2))  # [B, Hkv, G*c, Nk]
    s = s.view(b, hkv, hq // hkv, c, -1) * scale
    m = mask_heads_as_groups(mask_c, hq, hkv)
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(cdt)
    lse = torch.logsumexp(s, dim=-1)
    seen = ~torch.isinf(lse)
    p = torch.exp(s - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = torch.matmul(p.flatten(2, 3), v.to(cdt)).view(b, hkv, hq // hkv, c, -1)
    return out.reshape(b, hq, c, -1).to(q_c.dtype), lse.reshape(b, hq, c)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_rows: MaskRows,
    scale: float,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a dense mask produced a chunk of rows at a time.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``.
        mask_rows: ``(r0, r1) -> [Bm, Hm, r1 - r0, Nk]`` bool (True = visible) or additive float.
        chunk: query rows per step.
    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype and ``lse [B, Hq, Nq]`` float32; rows that see nothing give 0 / -inf.
    """
    outs, lses = [], []
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    for r0 in range(0, q.shape[2], chunk):
        r1 = min(r0 + chunk, q.shape[2])
        args = (q[:, :, r0:r1], k, v, mask_rows(r0, r1), scale)
        o, lse = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# The backend entry (``impl="dense"``, fm_parallel/backends.py): not chunked (no forward / backward
# launchers for the ring), so it runs only where the whole mask is local.
def attention(q, k, v, mask, positions, scale: float, q_offset: int | None = None, deterministic: bool = True,
              mask_rows: MaskRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`dense_attention` under ``mask`` (a FlashMask, pictured a chunk of rows
    at a time at ``positions``), or under ``mask_rows`` when given (a dense mask no FlashMask expresses).
    Deterministic whatever ``deterministic`` says (plain PyTorch)."""
    if mask_rows is None:
        mask_rows = lambda r0, r1: mask.to_dense(rows=positions[r0:r1])  # noqa: E731
    return dense_attention(q, k, v, mask_rows, scale)
