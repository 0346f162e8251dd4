"""The FlashMask predicate as a CuTe DSL ``mask_mod`` for FlashAttention-4's kernels.

FA4 calls ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` once per score it must
mask, only inside the tiles that the block-sparsity lists mark partial (fully visible tiles skip it,
skipped tiles are never visited). Ours reads three auxiliary tensors:

    aux_tensors[0] = fms   [Bm, Hm, Nk, M] int32   first visible row of each interval
    aux_tensors[1] = fme   [Bm, Hm, Nk, M] int32   last visible row (inclusive)
    aux_tensors[2] = rows  [Nq] int32              global row of each local query (q_offset, zigzag)

and returns ``OR_m (fms[b, h, j, m] <= rows[i] <= fme[b, h, j, m])``, the same rule as
:meth:`fm_parallel.masks.FlashMask.to_dense`. The indices FA4 passes stay in bounds past the last
tile: with auxiliary tensors it wraps ``q_idx`` / ``kv_idx`` modulo the sequence lengths and masks
the out-of-range scores itself.

What is compiled in (the "shape class"): whether the mask has one batch row for all (``Bm == 1``),
how many query heads share a mask head, and the number of intervals ``M``. Everything else — the
bounds, the lengths, the rows — is runtime data, so a new mask of the same class reuses the compiled
kernel. FA4 keys its compile cache on the function's source and closure values, and
:func:`flashmask_mask_mod` returns the same function object for the same class.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute import utils as fa4_utils

__all__ = ["flashmask_mask_mod"]


@functools.lru_cache(maxsize=None)
def flashmask_mask_mod(batch_broadcast: bool, q_per_mask_head: int, intervals: int):
    """The ``mask_mod`` for masks with ``Bm == 1`` (``batch_broadcast``), ``Hq / Hm`` query heads per
    mask head and ``intervals`` intervals per column (1..4)."""
    if not 1 <= intervals <= 4:
        raise ValueError(f"intervals: expected 1..4 per column, got {intervals}")
    if q_per_mask_head < 1:
        raise ValueError(f"q_per_mask_head: expected >= 1, got {q_per_mask_head}")
    batch_factor = 0 if batch_broadcast else 1  # batch index times 0: row 0 serves every batch entry

    @cute.jit
    def flashmask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        fms, fme, rows = aux_tensors[0], aux_tensors[1], aux_tensors[2]
        b = batch[0] * batch_factor
        h = head[0] // q_per_mask_head  # FA4 passes the query head, also under PackGQA
        j = kv_idx[0]
        row = fa4_utils.scalar_to_ssa(rows[q_idx[0]], Int32)
        first = fa4_utils.scalar_to_ssa(fms[b, h, j, 0], Int32)
        last = fa4_utils.scalar_to_ssa(fme[b, h, j, 0], Int32)
        visible = (first <= row) & (row <= last)
        for m in cutlass.range_constexpr(1, intervals):
            first = fa4_utils.scalar_to_ssa(fms[b, h, j, m], Int32)
            last = fa4_utils.scalar_to_ssa(fme[b, h, j, m], Int32)
            visible = visible | ((first <= row) & (row <= last))
        return visible

    return flashmask_mod
