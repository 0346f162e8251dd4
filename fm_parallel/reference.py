"""PyTorch implementations: the fp64 dense oracle and the blockwise path (``impl="torch"``).

``reference_attention`` materialises the whole mask and score matrix in float64; tests compare every
other implementation with it.

``blockwise_attention`` is the CPU backend. For each block of ``block_q`` queries it asks the tile
rule (:func:`fm_parallel.masks.classify_tiles`) which key blocks to visit, gathers only those
(contiguous runs are views, not copies), applies mask math only to the columns of partial tiles,
and does one softmax over the gathered keys. Memory is O(block_q x visible keys) per step, never
N x N. The backward recomputes scores per query block from the saved log-sum-exp (FlashAttention-2
style) rather than storing them. GQA is handled by viewing queries as ``[B, Hkv, G, N, D]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fm_parallel.derived import derived_for_mask
from fm_parallel.heads import group_queries, mask_groups, mask_heads_as_groups
from fm_parallel.masks.blocks import TileClass, classify_tiles, row_block_bounds
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["reference_attention", "blockwise_attention", "forward", "backward", "attention", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 128


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0, so exp(s - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask,
    scale: float | None = None,
    q_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention, the oracle.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``.
        mask: ``[Bm, Hm, Nk, M]`` bounds.
        q_positions: ``[Nq]`` global row of each query (default ``0 .. Nq-1``).
    Returns:
        ``out [B, Hq, Nq, Dv]`` and ``lse [B, Hq, Nq]``, float64; rows that see no key give 0 and -inf.
    """
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = torch.arange(nq, device=q.device) if q_positions is None else q_positions
    visible = mask_heads_as_groups(mask.to_dense(rows=rows), hq, hkv)  # [Bm, Hkv|1, G|1, Nq, Nk]
    q5 = group_queries(q.double(), hkv)
    s = torch.einsum("bhgnd,bhmd->bhgnm", q5, k.double()) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse).unsqueeze(-1))
    out = torch.einsum("bhgnm,bhmd->bhgnd", p, v.double())
    return out.reshape(b, hq, nq, -1), lse.reshape(b, hq, nq)


# --------------------------------------------------------------- blockwise
@dataclass
class _RowBlock:
    """What one block of queries visits: key column spans to gather and the partial tiles among them."""

    r0: int
    r1: int
    spans: list[tuple[int, int]]
    partial: list[tuple[int, int, int]]  # (offset inside the gathered keys, first key, end key) per partial tile


def _plan(mask: FlashMask, positions: torch.Tensor, block_q: int, block_k: int, q_offset: int | None = None):
    """Per mask row ``[Bm * Hm]``, per query block: the tiles to visit, from the tile rule. Cached (this
    backend's store, :func:`fm_parallel.derived.derived_for_mask`) for consecutive rows (``positions`` is ``q_offset + arange``)."""
    if q_offset is not None:
        key = ("torch_plan", block_q, block_k, q_offset, positions.numel())
        return derived_for_mask("torch").get((mask,), key, lambda: _plan(mask, positions, block_q, block_k))
    lo, hi = row_block_bounds(positions, block_q)
    classes = classify_tiles(mask.block_summary(block_k), lo, hi).cpu()  # [Bm, Hm, Tr, Tc]
    nq, nk = positions.numel(), mask.num_keys
    plans = []
    for row_classes in classes.flatten(0, 1).tolist():
        blocks = []
        for i, tiles in enumerate(row_classes):
            spans: list[tuple[int, int]] = []
            partial: list[tuple[int, int, int]] = []
            width = 0
            for c, cls in enumerate(tiles):
                if cls == TileClass.SKIP:
                    continue
                c0, c1 = c * block_k, min((c + 1) * block_k, nk)
                if cls == TileClass.PARTIAL:
                    partial.append((width, c0, c1))
                if spans and spans[-1][1] == c0:
                    spans[-1] = (spans[-1][0], c1)
                else:
                    spans.append((c0, c1))
                width += c1 - c0
            blocks.append(_RowBlock(i * block_q, min((i + 1) * block_q, nq), spans, partial))
        plans.append(blocks)
    return plans


def _gather(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Keys of the visited spans along dim -2 (a view when there is one span)."""
    if len(spans) == 1:
        return x[..., spans[0][0] : spans[0][1], :]
    return torch.cat([x[..., c0:c1, :] for c0, c1 in spans], dim=-2)


def _scores(q_t, k_t, blk: _RowBlock, mask: FlashMask, grp, rows: torch.Tensor, g_n: int) -> torch.Tensor:
    """Scores ``[b, kv, g*br, nc]`` (q_t already scaled), -inf on masked entries of partial tiles only."""
    s = torch.matmul(q_t, k_t.transpose(-1, -2))
    if blk.partial:
        fms, fme = mask.fms[grp.mask_b, grp.mask_h], mask.fme[grp.mask_b, grp.mask_h]  # [Nk, M]
        r = rows.view(-1, 1, 1)
        s5 = s.unflatten(-2, (g_n, rows.numel()))  # [b, kv, g, br, nc] view
        for offset, c0, c1 in blk.partial:
            hidden = ~((fms[c0:c1] <= r) & (r <= fme[c0:c1])).any(-1)  # [br, w]
            s5[..., offset : offset + c1 - c0].masked_fill_(hidden, float("-inf"))
    return s


def _blockwise_forward(q, k, v, mask, positions, scale, plans):
    b, hq, nq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q5 = group_queries(q, hkv)
    out5 = torch.zeros(b, hkv, hq // hkv, nq, dv, dtype=q.dtype, device=q.device)
    lse5 = torch.full((b, hkv, hq // hkv, nq), float("-inf"), dtype=cdt, device=q.device)
    for grp in mask_groups(b, hq, hkv, mask.batch, mask.heads):
        q_g = q5[grp.batch, grp.kv, grp.group]
        k_g, v_g = k[grp.batch, grp.kv], v[grp.batch, grp.kv]
        bn, kn, gn = q_g.shape[:3]
        for blk in plans[grp.mask_b * mask.heads + grp.mask_h]:
            if not blk.spans:
                continue  # every tile skipped: out stays 0, lse stays -inf
            br = blk.r1 - blk.r0
            q_t = q_g[..., blk.r0 : blk.r1, :].reshape(bn, kn, gn * br, -1).to(cdt) * scale
            k_t, v_t = _gather(k_g, blk.spans).to(cdt), _gather(v_g, blk.spans).to(cdt)
            s = _scores(q_t, k_t, blk, mask, grp, positions[blk.r0 : blk.r1], gn)
            # Softmax in place on the score buffer; rows that see nothing have max -inf and sum 0.
            mx = s.amax(dim=-1, keepdim=True)
            p = s.sub_(_safe(mx)).exp_()
            total = p.sum(dim=-1, keepdim=True)
            o = torch.matmul(p, v_t) / torch.where(total > 0, total, torch.ones_like(total))
            out5[grp.batch, grp.kv, grp.group, blk.r0 : blk.r1] = o.view(bn, kn, gn, br, dv).to(q.dtype)
            lse5[grp.batch, grp.kv, grp.group, blk.r0 : blk.r1] = (mx + total.log()).view(bn, kn, gn, br)
    return out5.view(b, hq, nq, dv), lse5.view(b, hq, nq)


def _blockwise_backward(q, k, v, out, lse, dout, dlse, mask, positions, scale, plans):
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # [B, Hq, Nq]
    if dlse is not None:
        delta = delta - dlse.to(cdt)  # d lse_i / d s_ij = p_ij folds into the same correction
    q5, do5 = group_queries(q, hkv), group_queries(dout, hkv)
    lse5, delta5 = lse.view(*q5.shape[:4]), delta.view(*q5.shape[:4])
    dq5 = torch.zeros(q5.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    for grp in mask_groups(b, hq, hkv, mask.batch, mask.heads):
        q_g, do_g = q5[grp.batch, grp.kv, grp.group], do5[grp.batch, grp.kv, grp.group]
        k_g, v_g = k[grp.batch, grp.kv], v[grp.batch, grp.kv]
        bn, kn, gn = q_g.shape[:3]
        for blk in plans[grp.mask_b * mask.heads + grp.mask_h]:
            if not blk.spans:
                continue
            br = blk.r1 - blk.r0
            rows = slice(blk.r0, blk.r1)
            q_t = q_g[..., rows, :].reshape(bn, kn, gn * br, -1).to(cdt) * scale
            do_t = do_g[..., rows, :].reshape(bn, kn, gn * br, -1).to(cdt)
            lse_t = lse5[grp.batch, grp.kv, grp.group, rows].reshape(bn, kn, gn * br, 1).to(cdt)
            delta_t = delta5[grp.batch, grp.kv, grp.group, rows].reshape(bn, kn, gn * br, 1)
            k_t, v_t = _gather(k_g, blk.spans).to(cdt), _gather(v_g, blk.spans).to(cdt)
            p = _scores(q_t, k_t, blk, mask, grp, positions[rows], gn).sub_(_safe(lse_t)).exp_()
            ds = torch.matmul(do_t, v_t.transpose(-1, -2)).sub_(delta_t).mul_(p)
            dq5[grp.batch, grp.kv, grp.group, rows] = (torch.matmul(ds, k_t) * scale).view(bn, kn, gn, br, -1)
            dk_t = torch.matmul(ds.transpose(-1, -2), q_t)  # q_t carries the scale
            dv_t = torch.matmul(p.transpose(-1, -2), do_t)
            offset = 0
            for c0, c1 in blk.spans:
                w = c1 - c0
                dk[grp.batch, grp.kv, c0:c1] += dk_t[..., offset : offset + w, :]
                dv[grp.batch, grp.kv, c0:c1] += dv_t[..., offset : offset + w, :]
                offset += w
    return dq5.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, positions, scale, block_q, block_k):
        plans = _plan(mask, positions, block_q, block_k)
        out, lse = _blockwise_forward(q, k, v, mask, positions, scale, plans)
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.mask, ctx.scale, ctx.plans = mask, scale, plans
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, positions = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _blockwise_backward(q, k, v, out, lse, dout, dlse, ctx.mask, positions, ctx.scale, ctx.plans)
        return dq, dk, dv, None, None, None, None, None


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask,
    positions: torch.Tensor,
    scale: float,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile-skipping attention in PyTorch (differentiable, inputs assumed validated).

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``.
        mask: FlashMask with ``Nk`` columns. positions: ``[Nq]`` int32 or int64 global query rows.
    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype, ``lse [B, Hq, Nq]`` float32 (float64 for float64 inputs;
        -inf where a row sees nothing).
    """
    return _BlockwiseAttention.apply(q, k, v, mask, positions, scale, block_q, block_k)


# The backend interface (fm_parallel.backends): launchers for code with its own backward (the ring),
# and the differentiable call.
def forward(q, k, v, mask: FlashMask, positions, scale: float, q_offset: int | None = None):
    """``out [B, Hq, Nq, Dv]`` and ``lse [B, Hq, Nq]``, float32 (float64 for float64 inputs)."""
    plans = _plan(mask, positions, DEFAULT_BLOCK, DEFAULT_BLOCK, q_offset)
    return _blockwise_forward(q, k, v, mask, positions, scale, plans)


def backward(q, k, v, out, lse, dout, mask: FlashMask, positions, scale: float, dlse=None, q_offset: int | None = None,
             deterministic: bool = True):
    """``(dq, dk, dv)`` from the (possibly ring-merged) ``out`` and ``lse``; always reproducible."""
    plans = _plan(mask, positions, DEFAULT_BLOCK, DEFAULT_BLOCK, q_offset)
    return _blockwise_backward(q, k, v, out, lse, dout, dlse, mask, positions, scale, plans)


def attention(q, k, v, mask: FlashMask, positions, scale: float, q_offset: int | None = None, deterministic: bool = True,
              block_size: int = DEFAULT_BLOCK):
    """Differentiable blockwise attention (``impl="torch"``)."""
    return blockwise_attention(q, k, v, mask, positions, scale, block_size, block_size)
