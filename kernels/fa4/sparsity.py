"""What FlashAttention-4's kernels take from a FlashMask: block-sparsity tensors (through the shared
tile rule) and the column bounds packed for the ``mask_mod`` (:func:`pack_bounds`).

FA4's CuTe kernels (``flash_attn.cute``, the version :mod:`.pin` names) take block sparsity as
dense index lists: per query block, the count and indices of fully visible key blocks (run without
``mask_mod``) and of partial key blocks (run with it); the backward takes the transposed lists, per
key block. Skipped tiles appear in neither. This module builds both from the same classification as
our Triton launch plans (:func:`fm_parallel.masks.blocks.tile_classes`), so the two
backends can never disagree on which tiles a mask visits.

Shapes: forward counts ``[B, H, T_q]`` and indices ``[B, H, T_q, T_k]``; backward counts
``[B, H, T_k]`` and indices ``[B, H, T_k, T_q]``; int32; ``B`` and ``H`` are the mask's (1 broadcasts,
FA4 expands it), except that a mask with one head per KV head is repeated to the query heads
(FA4 counts per query head). Within a list the block indices ascend; entries past the count are 0.

The tile shape must be one FA4's SM90 kernels accept in both passes (:func:`fa4_tile_shape`); the
kernel-side half, the ``mask_mod``, is :mod:`.mask_mod`, and the backend :mod:`.backend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fm_parallel.masks.blocks import TileClass, tile_classes
from fm_parallel.masks.flashmask import FlashMask

from fm_parallel.kernels.plan import consecutive_ranges, launch_order, packed_ranges

__all__ = ["BLOCK_Q", "FA4BlockSparsity", "cost_order", "fa4_block_sparsity", "fa4_block_sparsity_consecutive",
           "fa4_tile_shape", "pack_bounds"]


def pack_bounds(fms: torch.Tensor, fme: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """``[Bm, Hm, Nk, M]`` int64 ``((fme - row_offset) << 32) | ((fms - row_offset) & 0xffffffff)``.

    Shifting by ``row_offset`` (the global row of local query 0) lets the kernel compare the local
    query index directly; empty intervals (``fms > fme``) stay empty. Rows are below 2^31, so the
    shifted bounds fit in int32."""
    first = fms.to(torch.int64) - row_offset
    last = fme.to(torch.int64) - row_offset
    return ((last << 32) | (first & 0xFFFFFFFF)).contiguous()


# The query block of the lists at every head dim; the CuTe scheduler relies on it (one list block covers
# BLOCK_Q // tile_m forward tiles of tile_m rows).
BLOCK_Q = 128


def fa4_tile_shape(head_dim: int) -> tuple[int, int]:
    """(query block, key block) of FA4's SM90 kernels with block sparsity, forward and backward alike.

    FA4 needs the sparse key block equal to its key tile in both passes and the query block a
    multiple of its query tile (flash_attn/cute/interface.py, ``_tile_size_fwd_sm90`` /
    ``_tile_size_bwd_sm90`` and the block-sparse fitting of the pinned version). Key tiles: forward 128 for
    D <= 128, 128/112 -> fitted down to 96 for D <= 192 (backward 96), 80 -> fitted to 64 for D <= 256
    (backward 64 with sparsity); query tiles 64..128 divide 128 everywhere.
    """
    if not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim: expected 8..256 for FA4's SM90 kernels, got {head_dim}")
    if head_dim <= 128:
        return BLOCK_Q, 128
    return (BLOCK_Q, 96) if head_dim <= 192 else (BLOCK_Q, 64)


@dataclass(frozen=True)
class FA4BlockSparsity:
    """One orientation's lists (``transposed``: per key block, for the backward)."""

    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    block_size: tuple[int, int]  # (query block, key block), tokens
    transposed: bool
    # Backward only: for entry i of key block n's lists (query block m), the rank of n among the key
    # blocks query block m visits, ascending. FA4's deterministic backward adds dQ contributions in
    # this order (a semaphore per query block), so the sum is the same on every run.
    dq_write_order: torch.Tensor | None = None
    dq_write_order_full: torch.Tensor | None = None

    def to_fa4(self):
        """The ``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch`` FA4's interface takes."""
        try:
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        except ImportError as e:  # the optional [cute] extra
            raise ImportError("FA4 block sparsity needs flash-attn-4 (pip install 'fm_parallel[cute]'; "
                              "launch/bench/fa4_wheels recipe for the H200)") from e
        return BlockSparseTensorsTorch(mask_block_cnt=self.mask_block_cnt, mask_block_idx=self.mask_block_idx,
                                       full_block_cnt=self.full_block_cnt, full_block_idx=self.full_block_idx,
                                       block_size=self.block_size, dq_write_order=self.dq_write_order,
                                       dq_write_order_full=self.dq_write_order_full,
                                       # ascending ranks (FA4's "spt" order would be descending)
                                       spt=False if self.dq_write_order is not None else None)

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


def cost_order(lists: FA4BlockSparsity) -> torch.Tensor:
    """The order in which FA4's CTAs run one pass's outer blocks (query blocks; key blocks when
    ``transposed``): :func:`fm_parallel.kernels.plan.launch_order` of the tiles each visits (full + partial, summed over
    the lists' batch and heads), the order the Triton plans use too. Read by
    :class:`.cost_schedule.CostOrderScheduler` from the last auxiliary tensor."""
    cost = lists.full_block_cnt + lists.mask_block_cnt  # [B, H, T]
    return launch_order(cost.sum((0, 1)), cost.shape[0] * cost.shape[1])


def _check_tile_shape(block_q: int, block_k: int) -> None:
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q, block_k: expected positive tile sizes, got {block_q}, {block_k}")


def _head_repeat(mask: FlashMask, num_heads: int | None) -> int:
    """How often each mask head is repeated for FA4, which counts per query head: 1 for one mask head
    or one per query head, ``num_heads / Hm`` for one per KV head."""
    if mask.heads in (1, num_heads or mask.heads):
        return 1
    if num_heads is None or num_heads % mask.heads:
        raise ValueError(f"num_heads: expected a multiple of the mask's {mask.heads} heads, got {num_heads}")
    return num_heads // mask.heads


def _lists(flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts ``[..., T_outer]`` and ascending indices ``[..., T_outer, T_inner]`` of the True entries."""
    inner = flag.shape[-1]
    count = flag.sum(-1, dtype=torch.int32)
    # Compaction without a sort: flagged entry k goes to slot (number of flagged before it); the others
    # go to a spare last column that is dropped. Slots past the count stay 0.
    slot = torch.where(flag, flag.cumsum(-1) - 1, inner)
    index = torch.zeros(*flag.shape[:-1], inner + 1, dtype=torch.int32, device=flag.device)
    columns = torch.arange(inner, dtype=torch.int32, device=flag.device).expand_as(flag)
    index.scatter_(-1, slot, columns)
    return count, index[..., :inner].contiguous()


def fa4_block_sparsity(mask: FlashMask, block_q: int, block_k: int, num_heads: int | None = None,
                       positions: torch.Tensor | None = None, write_order: bool = False,
                       ) -> tuple[FA4BlockSparsity, FA4BlockSparsity]:
    """(forward, backward) block sparsity of ``mask`` for query rows at ``positions`` (default all
    ``mask.num_rows`` rows) in ``block_q x block_k`` tiles. ``num_heads``: the query heads, needed
    when the mask has one head per KV head. ``write_order``: also the backward's ``dq_write_order``
    for FA4's deterministic block-sparse backward (SM100; the pinned version has none on SM90)."""
    _check_tile_shape(block_q, block_k)
    if positions is None:
        positions = torch.arange(mask.num_rows, device=mask.device)
    cls = tile_classes(mask, positions, block_q, block_k)  # [Bm, Hm, T_q, T_k]; ragged last key block never FULL
    if (repeat := _head_repeat(mask, num_heads)) > 1:
        cls = cls.repeat_interleave(repeat, dim=1)
    fwd_full_cnt, fwd_full_idx = _lists(cls == TileClass.FULL)
    fwd_part_cnt, fwd_part_idx = _lists(cls == TileClass.PARTIAL)
    fwd = FA4BlockSparsity(fwd_full_cnt, fwd_full_idx, fwd_part_cnt, fwd_part_idx, (block_q, block_k), False)
    cls_t = cls.transpose(-1, -2)
    full_cnt, full_idx = _lists(cls_t == TileClass.FULL)
    part_cnt, part_idx = _lists(cls_t == TileClass.PARTIAL)
    order = order_full = None
    if write_order:
        # Rank of each key block among the visited ones of its query block (exclusive prefix count),
        # read at the backward lists' entries.
        visited = (cls != TileClass.SKIP).to(torch.int32)
        rank_t = (visited.cumsum(-1, dtype=torch.int32) - visited).transpose(-1, -2)  # [B, H, T_k, T_q]
        order = torch.gather(rank_t, -1, part_idx.long()).contiguous()
        order_full = torch.gather(rank_t, -1, full_idx.long()).contiguous()
    bwd = FA4BlockSparsity(full_cnt, full_idx, part_cnt, part_idx, (block_q, block_k), True, order, order_full)
    return fwd, bwd


def fa4_block_sparsity_consecutive(mask: FlashMask, block_q: int, block_k: int, num_heads: int | None,
                                   row_offset: int, num_rows: int) -> tuple[FA4BlockSparsity, FA4BlockSparsity]:
    """:func:`fa4_block_sparsity` for the consecutive rows ``row_offset .. row_offset + num_rows - 1``
    (a whole mask, a ring chunk), built on the GPU by :func:`fm_parallel.kernels.triton.plan.lists_from_ranges` from the
    tile ranges: two kernel launches and about thirty small operations, no host sync, instead of the
    dense tile grid's compaction (what a new mask costs per call). Same lists (tested)."""
    from fm_parallel.kernels.triton.plan import lists_from_ranges

    _check_tile_shape(block_q, block_k)
    ranges, tq, tk = consecutive_ranges(mask, row_offset, num_rows, block_q, block_k)
    packed = packed_ranges(ranges)  # [Bm * Hm, 4M, T_k]
    repeat = _head_repeat(mask, num_heads)
    if repeat > 1:
        packed = packed.view(mask.batch, mask.heads, *packed.shape[1:]).repeat_interleave(repeat, dim=1).flatten(0, 1)
    heads = mask.heads * repeat
    out = []
    for transposed in (False, True):
        full_cnt, full_idx, part_cnt, part_idx = (
            x.view(mask.batch, heads, *x.shape[1:]) for x in lists_from_ranges(packed, tq, transposed))
        out.append(FA4BlockSparsity(full_cnt, full_idx, part_cnt, part_idx, (block_q, block_k), transposed))
    return out[0], out[1]
