"""Converters between FlashMask and the peers' mask formats, so users can check us against them.

* PaddlePaddle's ``flashmask_attention(q, k, v, startend_row_indices, causal)``: per key column ``j``
  the *masked* rows, as ``[B, H, Nk, 1 | 2 | 4]`` int32 (``LTS``, ``LTE``, ``UTS``, ``UTE``; ends
  exclusive), compared with the raw query row ``i`` in ``[0, Nq)``: Paddle's kernels do not clip them
  to a triangle (PaddlePaddle/flash-attention, ``csrc/flashmask_v2/flash_mask.hpp``
  ``apply_flashmask_bwd``, and ``flashmask/flash_mask/cute/mask.py`` ``apply_flashmask_sm90``):

  ====================  =======================================================================
  causal=True,  [.., 1]  masked iff ``i >= LTS``, or ``i < j - (Nk - Nq)`` (causal)
  causal=True,  [.., 2]  masked iff ``LTS <= i < LTE``, or ``i < j - (Nk - Nq)`` (causal)
  causal=False, [.., 2]  masked iff ``i >= LTS`` or ``i < UTE``
  causal=False, [.., 4]  masked iff ``LTS <= i < LTE`` or ``UTS <= i < UTE``
  ====================  =======================================================================

  The causal part is aligned bottom-right as in FlashAttention 2.1+ and Paddle's test reference
  (``flashmask/tests/generate_startend_row_indices.py``, ``startend_row_indices_to_attn_bias``).
  Paddle refuses every other form (``flashmask_attention_v3/interface.py``: int32 only, rank 4,
  widths 1 | 2 causal and 2 | 4 non-causal), and so does :func:`from_paddle`.

* FlexAttention: a ``mask_mod(b, h, q_idx, kv_idx)`` reading the bounds, and a ``BlockMask`` from it.
"""

from __future__ import annotations

import torch

from fm_parallel.masks import intervals
from fm_parallel.masks.builders import check_bool, check_int
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.masks.intervals import MaskNotExpressible

__all__ = ["to_paddle", "from_paddle", "to_flex_mask_mod", "to_block_mask"]

_PADDLE_WIDTHS = {True: (1, 2), False: (2, 4)}


def _causal_rows(nq: int, nk: int, device) -> torch.Tensor:
    """``[Nk]`` int64: Paddle's causal part masks rows ``i < c[j]`` of column ``j`` (bottom-right
    alignment: the last query row sees the last key), ``c[j] = clamp(j - (Nk - Nq), 0, Nq)``."""
    return (torch.arange(nk, device=device, dtype=torch.int64) - (nk - nq)).clamp(0, nq)


def from_paddle(startend_row_indices: torch.Tensor, causal: bool, seqlen_q: int | None = None) -> FlashMask:
    """Paddle's masked-row form to the FlashMask that Paddle's kernels compute.

    Args:
        startend_row_indices: ``[B, H, Nk, W]`` int32, ``W`` in ``{1, 2}`` with ``causal`` and ``{2, 4}``
            without (the forms Paddle's ``flashmask_attention`` accepts), rows ``>= 0``.
        causal: Paddle's ``causal`` flag (bottom-right aligned when ``seqlen_q != Nk``).
        seqlen_q: ``Nq``, the number of query rows (default ``Nk``); values past it mask nothing more.
    Returns:
        A ``[B, H, Nk, M]`` FlashMask with ``num_rows = Nq``, ``M <= 3``: each column sees the rows of
        ``[0, Nq)`` that none of its masked ranges holds (see the module docstring).
    """
    causal = check_bool("causal", causal)
    x = startend_row_indices
    widths = _PADDLE_WIDTHS[causal]
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype != torch.int32 or x.shape[-1] not in widths:
        got = f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"startend_row_indices: expected an int32 tensor [B, H, Nk, {' or '.join(map(str, widths))}] "
            f"with causal={causal} (the forms Paddle accepts), got {got}"
        )
    nk = x.shape[2]
    if x.numel() == 0:
        raise ValueError(f"startend_row_indices: expected at least one key column, got shape {tuple(x.shape)}")
    nq = nk if seqlen_q is None else check_int("seqlen_q", seqlen_q, low=1)
    low = int(x.min())
    if low < 0:
        # Paddle's kernels would mask every row (i >= -3) where its reference masks the last ones
        # (a Python slice [-3:]): no answer to match, so refuse.
        idx = tuple(torch.nonzero(x < 0)[0].tolist())
        raise ValueError(f"startend_row_indices: expected rows >= 0, got startend_row_indices{list(idx)} = {int(x[idx])}")
    x = x.to(torch.int64)
    everything = torch.full_like(x[..., 0], nq)
    if causal:
        lte = x[..., 1] if x.shape[-1] == 2 else everything
        upper = torch.zeros_like(everything), _causal_rows(nq, nk, x.device).expand_as(everything)
    elif x.shape[-1] == 2:
        lte, upper = everything, (torch.zeros_like(everything), x[..., 1])
    else:
        lte, upper = x[..., 1], (x[..., 2], x[..., 3])
    # Masked ranges [start, end) to inclusive intervals; the visible rows are their complement.
    starts = torch.stack([x[..., 0], upper[0]], dim=-1)
    ends = torch.stack([lte, upper[1]], dim=-1) - 1
    fms, fme = intervals.complement(starts, ends, nq, max_intervals=None)
    return FlashMask(fms, fme, nq, validate=False)


def to_paddle(mask: FlashMask) -> tuple[torch.Tensor, bool]:
    """The smallest form ``(startend_row_indices, causal)`` that Paddle accepts and that is the mask
    exactly (``from_paddle(*to_paddle(m), seqlen_q=m.num_rows)`` is ``m``): ``[B, Hm, Nk, W]`` int32.

    Tried in order: causal width 1, causal width 2, non-causal width 2 (the visible rows of every
    column one range), non-causal width 4 (the masked rows of every column at most two ranges).
    Empty masked ranges are written ``[Nq, Nq)`` below and ``[0, 0)`` above, as Paddle's generators do.

    Raises:
        MaskNotExpressible: some column's masked rows are more than two ranges.
    """
    if not isinstance(mask, FlashMask):
        raise ValueError(f"mask: expected a FlashMask, got {type(mask).__name__}")
    nq, nk, device = mask.num_rows, mask.num_keys, mask.device
    vis_s, vis_e = (t.to(torch.int64) for t in intervals.normalize(mask.fms, mask.fme, nq, None))
    masked = intervals.complement(vis_s, vis_e, nq, None)
    c = _causal_rows(nq, nk, device)
    nothing = torch.full_like(vis_s[..., 0], nq)

    def form(parts, causal):
        return torch.stack(parts, dim=-1).to(torch.int32), causal

    # Causal: no column sees a row above the bottom-right diagonal (empty slots start at nq).
    if bool((vis_s[..., 0] >= c).all()):
        below = intervals.intersect(masked, (c.view(nk, 1), torch.full((nk, 1), nq - 1, device=device)), nq, None)
        if below[0].shape[-1] == 1:
            ls, le = below[0][..., 0].to(torch.int64), below[1][..., 0].to(torch.int64)
            empty = ls > le
            lts = torch.where(empty, nothing, ls)
            if bool((empty | (le == nq - 1)).all()):
                return form([lts], True)
            return form([lts, torch.where(empty, nothing, le + 1)], True)
    if vis_s.shape[-1] == 1:
        s, e = vis_s[..., 0], vis_e[..., 0]
        empty = s > e
        # Visible [s, e]: masked rows >= e + 1 and < s; a column seen by no row masks rows < Nq.
        return form([torch.where(empty, nothing, e + 1), torch.where(empty, nothing, s)], False)
    ms, me = (t.to(torch.int64) for t in masked)
    if ms.shape[-1] > 2:
        counts = (ms <= me).sum(-1)
        first = int(torch.nonzero((counts > 2).reshape(-1))[0])
        raise MaskNotExpressible(
            first % nk, int(counts.max()), 2, "Paddle form",
            f"key column {first % nk} has {int(counts.reshape(-1)[first])} masked row ranges, "
            "Paddle's forms hold at most 2",
        )
    if ms.shape[-1] == 1:
        ms = torch.cat([ms, nothing.unsqueeze(-1)], -1)
        me = torch.cat([me, torch.full_like(me, -1)], -1)
    two = ms[..., 1] <= me[..., 1]
    # The range holding larger rows is Paddle's lower-left one (LTS, LTE), the other the upper-right:
    # with two ranges the second; with one, the lower when it starts at or below the (bottom-right) diagonal.
    one_low = ~two & (ms[..., 0] <= me[..., 0]) & (ms[..., 0] >= c)
    low_s = torch.where(two, ms[..., 1], torch.where(one_low, ms[..., 0], nothing))
    low_e = torch.where(two, me[..., 1] + 1, torch.where(one_low, me[..., 0] + 1, nothing))
    has_up = two | ((ms[..., 0] <= me[..., 0]) & ~one_low)
    zero = torch.zeros_like(nothing)
    up_s = torch.where(has_up, ms[..., 0], zero)
    up_e = torch.where(has_up, me[..., 0] + 1, zero)
    return form([low_s, low_e, up_s, up_e], False)


def to_flex_mask_mod(mask: FlashMask, q_heads: int | None = None):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` reading the bounds.

    Batch and head indices broadcast when the mask has ``B = 1`` or ``Hm = 1``. With ``Hm = H_kv < H_q``
    pass ``q_heads`` so that query head ``h`` reads mask head ``h // (H_q // Hm)``.
    """
    if not isinstance(mask, FlashMask):
        raise ValueError(f"mask: expected a FlashMask, got {type(mask).__name__}")
    if q_heads is not None:
        q_heads = check_int("q_heads", q_heads, low=1)
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

    block_size = check_int("block_size", block_size, low=1)
    if num_heads is not None:
        num_heads = check_int("num_heads", num_heads, low=1)
    heads = None if mask.heads == 1 else (num_heads or mask.heads)
    batch = None if mask.batch == 1 else mask.batch
    return create_block_mask(
        to_flex_mask_mod(mask, num_heads), batch, heads, mask.num_rows, mask.num_keys,
        device=str(mask.device), BLOCK_SIZE=block_size, **kwargs,
    )
