"""Converters between FlashMask and the peers' mask formats, so users can check us against them.

* PaddlePaddle's ``flashmask_attention(startend_row_indices, causal)``: per key column the *masked*
  rows, as ``[B, H, Nk, 1 | 2 | 4]`` int32 (``LTS``, ``LTE``, ``UTS``, ``UTE``; ends exclusive).
  The lower-left part of column ``j`` is rows ``i >= j``, the upper-right part rows ``i < j``:

  ====================  ===========================================================
  causal=True,  [.., 1]  rows ``>= LTS`` of the lower part masked; upper part masked
  causal=True,  [.., 2]  rows ``[LTS, LTE)`` of the lower part masked; upper masked
  causal=False, [.., 1]  rows ``>= LTS`` of the lower part masked
  causal=False, [.., 2]  rows ``>= LTS`` of the lower part and ``< UTE`` of the upper masked
  causal=False, [.., 4]  rows ``[LTS, LTE)`` of the lower and ``[UTS, UTE)`` of the upper masked
  ====================  ===========================================================

* FlexAttention: a ``mask_mod(b, h, q_idx, kv_idx)`` reading the bounds, and a ``BlockMask`` from it.
"""

from __future__ import annotations

import torch

from fm_parallel.masks import intervals
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.masks.intervals import MaskNotExpressible

__all__ = ["to_paddle", "from_paddle", "to_flex_mask_mod", "to_block_mask"]


def _triangles(n: int, device) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Lower ``[j, n-1]`` and upper ``[0, j-1]`` row ranges of every column, as ``[n, 1]`` intervals."""
    j = torch.arange(n, device=device, dtype=torch.int64).view(n, 1)
    return (j, torch.full_like(j, n - 1)), (torch.zeros_like(j), j - 1)


def from_paddle(startend_row_indices: torch.Tensor, causal: bool) -> FlashMask:
    """Paddle's masked-row form ``[B, H, Nk, 1 | 2 | 4]`` to a FlashMask (square: ``Nq = Nk``)."""
    x = startend_row_indices
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[-1] not in (1, 2, 4) or x.dtype.is_floating_point:
        got = (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"startend_row_indices: expected an int tensor [B, H, Nk, 1|2|4], got {got}")
    if causal and x.shape[-1] == 4:
        raise ValueError("startend_row_indices: expected 1 or 2 values per column when causal=True, got 4")
    n = x.shape[2]
    x = x.to(torch.int64)
    (low_s, low_e), (up_s, up_e) = _triangles(n, x.device)
    full_end = torch.full_like(x[..., 0], n)
    k = x.shape[-1]
    lts = x[..., 0]
    lte = x[..., 1] if (causal and k == 2) or k == 4 else full_end
    if causal:
        uts, ute = torch.zeros_like(lts), torch.arange(n, device=x.device).expand_as(lts)
    elif k == 1:
        uts = ute = torch.zeros_like(lts)
    elif k == 2:
        uts, ute = torch.zeros_like(lts), x[..., 1]
    else:
        uts, ute = x[..., 2], x[..., 3]
    # Masked rows, each clipped to its triangle; the visible rows are the complement.
    lower = intervals.intersect((lts.unsqueeze(-1), lte.unsqueeze(-1) - 1), (low_s, low_e), n, None)
    upper = intervals.intersect((uts.unsqueeze(-1), ute.unsqueeze(-1) - 1), (up_s, up_e), n, None)
    masked = intervals.union(lower, upper, n, None)
    fms, fme = intervals.complement(*masked, n, max_intervals=None)
    return FlashMask(fms, fme, n, validate=False)


def to_paddle(mask: FlashMask) -> tuple[torch.Tensor, bool]:
    """The smallest Paddle form ``(startend_row_indices, causal)`` that expresses the mask exactly.

    Raises:
        MaskNotExpressible: the masked rows of the lower or upper part of some column are not one
            interval (Paddle allows one of each), or the mask is not square.
    """
    n = mask.num_keys
    if mask.num_rows != n:
        raise MaskNotExpressible(None, None, None, "Paddle form", f"it needs a square mask, got {mask.num_rows} x {n}")
    (low_s, low_e), (up_s, up_e) = _triangles(n, mask.device)
    masked = intervals.complement(mask.fms, mask.fme, n, None)
    lower = intervals.intersect(masked, (low_s, low_e), n, 1, what="Paddle form (lower part)")
    upper = intervals.intersect(masked, (up_s, up_e), n, 1, what="Paddle form (upper part)")
    ls, le = lower[0][..., 0].to(torch.int64), lower[1][..., 0].to(torch.int64)
    us, ue = upper[0][..., 0].to(torch.int64), upper[1][..., 0].to(torch.int64)
    j = torch.arange(n, device=mask.device)
    lower_empty, upper_empty = ls > le, us > ue
    # Exclusive ends; an empty masked range is written as [n, n) below and [0, 0) above.
    lts = torch.where(lower_empty, torch.full_like(ls, n), ls)
    lte = torch.where(lower_empty, torch.full_like(le, n), le + 1)
    uts = torch.where(upper_empty, torch.zeros_like(us), us)
    ute = torch.where(upper_empty, torch.zeros_like(ue), ue + 1)
    lower_to_end = bool((lte == n).all())
    upper_from_top = bool((uts == 0).all())
    causal = bool(((j == 0) | ((uts == 0) & (ute == j))).all())
    if causal:
        parts = [lts] if lower_to_end else [lts, lte]
    elif lower_to_end and upper_from_top:
        parts = [lts] if bool((ute == 0).all()) else [lts, ute]
    else:
        parts = [lts, lte, uts, ute]
    return torch.stack(parts, dim=-1).to(torch.int32), causal


def to_flex_mask_mod(mask: FlashMask, q_heads: int | None = None):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` reading the bounds.

    Batch and head indices broadcast when the mask has ``B = 1`` or ``Hm = 1``. With ``Hm = H_kv < H_q``
    pass ``q_heads`` so that query head ``h`` reads mask head ``h // (H_q // Hm)``.
    """
    fms, fme = mask.fms, mask.fme
    b_mul = 1 if mask.batch > 1 else 0
    h_div = 1
    if mask.heads > 1 and q_heads is not None and q_heads != mask.heads:
        if q_heads % mask.heads:
            raise ValueError(f"q_heads: expected a multiple of the mask heads {mask.heads}, got {q_heads}")
        h_div = q_heads // mask.heads
    h_mul = 1 if mask.heads > 1 else 0
    slots = mask.max_intervals

    def mask_mod(b, h, q_idx, kv_idx):
        bi, hi = b * b_mul, (h // h_div) * h_mul
        visible = (fms[bi, hi, kv_idx, 0] <= q_idx) & (q_idx <= fme[bi, hi, kv_idx, 0])
        for m in range(1, slots):
            visible = visible | ((fms[bi, hi, kv_idx, m] <= q_idx) & (q_idx <= fme[bi, hi, kv_idx, m]))
        return visible

    return mask_mod


def to_block_mask(mask: FlashMask, num_heads: int | None = None, block_size: int = 128, **kwargs):
    """A FlexAttention ``BlockMask`` built from :func:`to_flex_mask_mod` (``Q_LEN = num_rows``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    heads = None if mask.heads == 1 else (num_heads or mask.heads)
    batch = None if mask.batch == 1 else mask.batch
    return create_block_mask(
        to_flex_mask_mod(mask, num_heads), batch, heads, mask.num_rows, mask.num_keys,
        device=str(mask.device), BLOCK_SIZE=block_size, **kwargs,
    )
