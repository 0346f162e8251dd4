"""The FlashMask predicate as a CuTe DSL ``mask_mod`` for FlashAttention-4's kernels.

FA4 calls ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` once per score it must
mask, only inside the tiles that the block-sparsity lists mark partial (fully visible tiles skip it,
skipped tiles are never visited). It returns ``OR_m (fms[b, h, j, m] <= row(i) <= fme[b, h, j, m])``,
the rule of :meth:`fm_parallel.masks.FlashMask.to_dense`, reading:

    aux_tensors[0] = bounds [Bm, Hm, Nk, M] int64   (fme << 32) | (fms & 0xffffffff), see
                                                    sparsity.pack_bounds
    aux_tensors[1] = rows   [Nq] int32              global row of each local query (explicit rows only)

Loads are what a mask_mod costs: FA4 evaluates it element by element and the compiler does not share
loads between the elements a thread holds (checked in the PTX: one load per element per tensor).
So both bounds of an interval come in one 64-bit load, and for consecutive rows (``q_offset``: whole
masks, ring chunks) the bounds are shifted by the offset beforehand (:func:`.sparsity.pack_bounds`), making the
local ``q_idx`` the row: one load per element and interval. Arbitrary rows (zigzag shards) read
``rows[q_idx]`` as well. The indices FA4 passes stay in bounds past the last tile: with auxiliary
tensors it wraps ``q_idx`` / ``kv_idx`` modulo the sequence lengths and masks those scores itself.

What is compiled in (the "shape class"): whether the mask has one batch row for all (``Bm == 1``),
how many query heads share a mask head, the number of intervals ``M`` and whether rows are explicit.
Everything else (bounds, lengths, rows, offsets) is runtime data, so a new mask of the same class
reuses the compiled kernel. FA4 keys its compile cache on the function's source and closure values,
and :func:`flashmask_mask_mod` returns the same function object for the same class.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from flash_attn.cute import utils as fa4_utils

from fm_parallel.kernels.fa4.spec import FlashMaskSpec, Options, register

__all__ = ["flashmask_mask_mod"]


@functools.lru_cache(maxsize=None)
def flashmask_mask_mod(batch_broadcast: bool, q_per_mask_head: int, intervals: int, explicit_rows: bool,
                       options: Options = Options()):
    """The ``mask_mod`` for masks with ``Bm == 1`` (``batch_broadcast``), ``Hq / Hm`` query heads per
    mask head, ``intervals`` intervals per column (1..4), and rows read from ``aux_tensors[1]``
    (``explicit_rows``) or equal to the local query index (bounds packed with the row offset).

    The function is registered with :mod:`.patches`: where ``options`` ask for it (default),
    FA4 kernels traced with it mask column-first and run their CTAs heaviest first (both passes); the
    per-score body below is what FA4 runs otherwise (PackGQA where the packed heads do not share a
    mask head, or FA4 not the pinned version)."""
    if not 1 <= intervals <= 4:
        raise ValueError(f"intervals: expected 1..4 per column, got {intervals}")
    if q_per_mask_head < 1:
        raise ValueError(f"q_per_mask_head: expected >= 1, got {q_per_mask_head}")
    batch_factor = 0 if batch_broadcast else 1  # batch index times 0: row 0 serves every batch entry

    @cute.jit
    def flashmask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        bounds = aux_tensors[0]
        b = batch[0] * batch_factor
        h = head[0] // q_per_mask_head  # FA4 passes the query head, also under PackGQA
        j = kv_idx[0]
        row = q_idx[0]
        if cutlass.const_expr(explicit_rows):
            row = aux_tensors[1][q_idx[0]]
        packed = bounds[b, h, j, 0]
        visible = (Int32(packed) <= row) & (row <= Int32(packed >> 32))
        for m in cutlass.range_constexpr(1, intervals):
            packed = bounds[b, h, j, m]
            visible = visible | ((Int32(packed) <= row) & (row <= Int32(packed >> 32)))
        return fa4_utils.scalar_to_ssa(visible, cutlass.Boolean)

    spec = FlashMaskSpec(batch_broadcast, q_per_mask_head, intervals, explicit_rows, options)
    register(flashmask_mod, spec)
    # FA4's compile cache keys a mask_mod on its source and closure; the options are neither (they act
    # through the patches), so the key is given explicitly: one compiled kernel per spec.
    flashmask_mod.__cute_hash__ = f"fm_parallel.flashmask_mask_mod/1:{spec!r}"
    return flashmask_mod
