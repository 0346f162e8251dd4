"""FlashAttention-4's block-sparsity tensors from a FlashMask, through the shared tile rule.

FA4's CuTe kernels (``flash_attn.cute``, pinned ``flash-attn-4==4.0.0b36``) take block sparsity as
dense index lists: per query block, the count and indices of fully visible key blocks (run without
``mask_mod``) and of partial key blocks (run with it); the backward takes the transposed lists, per
key block. Skipped tiles appear in neither. This module builds both from the same classification as
our Triton launch plans (:func:`fm_parallel.masks.classify_tiles` via ``plan._classes``), so the two
backends can never disagree on which tiles a mask visits.

Shapes: forward counts ``[B, H, T_q]`` and indices ``[B, H, T_q, T_k]``; backward counts
``[B, H, T_k]`` and indices ``[B, H, T_k, T_q]``; int32; ``B`` and ``H`` are the mask's (1 broadcasts,
FA4 expands it), except that a mask with one head per KV head is repeated to the query heads
(FA4 counts per query head). Within a list the block indices ascend; entries past the count are 0.

The kernel-side half of the ``cute`` backend (a CuTe DSL ``mask_mod`` reading ``fms`` / ``fme`` from
auxiliary tensors) is not here yet: it needs the H200 to verify (issue 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fm_parallel.masks.blocks import TileClass
from fm_parallel.masks.flashmask import FlashMask

from .plan import _classes

__all__ = ["FA4BlockSparsity", "fa4_block_sparsity"]


@dataclass(frozen=True)
class FA4BlockSparsity:
    """One orientation's lists (``transposed``: per key block, for the backward)."""

    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    block_size: tuple[int, int]  # (query block, key block), tokens
    transposed: bool

    def to_fa4(self):
        """The ``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch`` FA4's interface takes."""
        try:
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        except ImportError as e:  # the optional [cute] extra
            raise ImportError("FA4 block sparsity needs flash-attn-4 (pip install 'fm_parallel[cute]'; "
                              "launch/bench/fa4_wheels recipe for the H200)") from e
        return BlockSparseTensorsTorch(mask_block_cnt=self.mask_block_cnt, mask_block_idx=self.mask_block_idx,
                                       full_block_cnt=self.full_block_cnt, full_block_idx=self.full_block_idx,
                                       block_size=self.block_size)

    def classes(self) -> torch.Tensor:
        """The tile classes these lists describe, ``[B, H, T_outer, T_inner]`` int8 (for checks)."""
        b, h, outer, inner = self.full_block_idx.shape
        out = torch.full((b, h, outer, inner), int(TileClass.SKIP), dtype=torch.int8, device=self.full_block_idx.device)
        for cnt, idx, cls in ((self.full_block_cnt, self.full_block_idx, TileClass.FULL),
                              (self.mask_block_cnt, self.mask_block_idx, TileClass.PARTIAL)):
            valid = torch.arange(inner, device=idx.device) < cnt.unsqueeze(-1)
            rows = out.view(-1, inner)
            flat_idx = idx.reshape(-1, inner).long()
            row_ids = torch.arange(rows.shape[0], device=idx.device).unsqueeze(-1).expand_as(flat_idx)
            keep = valid.reshape(-1, inner)
            rows[row_ids[keep], flat_idx[keep]] = int(cls)
        return out


def _lists(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts ``[..., T_outer]`` and ascending indices ``[..., T_outer, T_inner]`` of the True entries."""
    count = flag.sum(-1, dtype=torch.int32)
    # A stable sort of "not flagged" puts the flagged block indices first, in ascending order.
    order = torch.sort((~flag).to(torch.int8), dim=-1, stable=True).indices
    index = torch.where(torch.arange(flag.shape[-1], device=flag.device) < count.unsqueeze(-1), order, torch.zeros_like(order))
    return count, index.to(torch.int32).contiguous()


def fa4_block_sparsity(mask: FlashMask, block_q: int, block_k: int, num_heads: int | None = None,
                       positions: torch.Tensor | None = None) -> tuple[FA4BlockSparsity, FA4BlockSparsity]:
    """(forward, backward) block sparsity of ``mask`` for query rows at ``positions`` (default all
    ``mask.num_rows`` rows) in ``block_q x block_k`` tiles. ``num_heads``: the query heads, needed
    when the mask has one head per KV head."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q, block_k: expected positive tile sizes, got {block_q}, {block_k}")
    if positions is None:
        positions = torch.arange(mask.num_rows, device=mask.device)
    cls = _classes(mask, positions, block_q, block_k)  # [Bm * Hm, T_q, T_k]; ragged last key block never FULL
    cls = cls.view(mask.batch, mask.heads, *cls.shape[1:])
    if mask.heads not in (1, num_heads or mask.heads):
        if num_heads is None or num_heads % mask.heads:
            raise ValueError(f"num_heads: expected a multiple of the mask's {mask.heads} heads, got {num_heads}")
        cls = cls.repeat_interleave(num_heads // mask.heads, dim=1)
    result = []
    for transposed in (False, True):
        c = cls.transpose(-1, -2) if transposed else cls
        full_cnt, full_idx = _lists(c == TileClass.FULL)
        part_cnt, part_idx = _lists(c == TileClass.PARTIAL)
        result.append(FA4BlockSparsity(full_cnt, full_idx, part_cnt, part_idx, (block_q, block_k), transposed))
    return result[0], result[1]
