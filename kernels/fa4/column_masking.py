"""Change 1 to FA4's SM90 kernels (:mod:`.patches`): FlashMask's partial tiles masked column first.

FA4 calls the ``mask_mod`` for each score a thread holds, and each call loads the column's bounds
again. FlashMask's predicate depends on the row only through a comparison, so here each thread loads
the bounds once per *column* it holds and compares every row against them (the forward's 2 rows x 32
columns per thread: 32 loads instead of 64; the backward's transposed scores a few instead of 64).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import min as dsl_min

__all__ = ["apply_flashmask"]


@cute.jit
def apply_flashmask(mask, acc_S: cute.Tensor, batch_idx: Int32, head_idx: Int32, m_block: Int32, n_block: Int32,
                     thr_mma: cute.TiledMma, mask_seqlen: cutlass.Constexpr[bool], aux_tensors,
                     spec: cutlass.Constexpr):
    """FA4's ``AttentionMask.apply_mask`` for a FlashMask ``mask_mod`` (same coordinates, swap_AB
    included): per column the bounds ``[Bm, Hm, Nk, M]`` int64 (``pack_bounds``) are loaded once,
    then each row of the thread is compared. Scores outside the sequences are masked like FA4 does
    when ``mask_seqlen``; the bounds are read at a clamped column there (never out of bounds)."""
    from quack import layout_utils

    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=mask.swap_AB)
    acc_shape = (mask.tile_m, mask.tile_n)
    cS = cute.make_identity_tensor(acc_shape if const_expr(not mask.swap_AB) else acc_shape[::-1])
    tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=mask.swap_AB)
    t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS), transpose=mask.swap_AB)
    ROW = 0 if const_expr(not mask.swap_AB) else 1
    COL = 1 if const_expr(not mask.swap_AB) else 0
    nrow = const_expr(cute.size(tScS_mn.shape[0]))
    ncol = const_expr(cute.size(tScS_mn.shape[1]))
    thr_col_offset = tScS_mn[0][COL]
    col_base = thr_col_offset + n_block * mask.tile_n
    bounds = aux_tensors[0]
    b = batch_idx * (0 if const_expr(spec.batch_broadcast) else 1)
    # Under PackGQA (forward, GQA) the tile's rows interleave the qpk query heads of KV head head_idx:
    # packed row p is row p // qpk of query head head_idx * qpk + p % qpk. Callers make sure those
    # heads share one mask head (q_per_mask_head a multiple of qpk), so the column loads stay per column.
    qpk = mask.qhead_per_kvhead_packgqa
    h = (head_idx * qpk) // spec.q_per_mask_head

    # Each thread's rows, once: the index in the sequence (for its end) and the FlashMask row
    # (consecutive: the same, the bounds being shifted by the row offset; explicit: aux_tensors[1]).
    # (comprehensions are plain Python at trace time: unrolled like range_constexpr)
    local_rows = [tScS_mn[r, 0][ROW] + m_block * mask.tile_m for r in range(nrow)]
    if const_expr(qpk != 1):
        local_rows = [row // qpk for row in local_rows]
    rows = local_rows
    if const_expr(spec.explicit_rows):
        rows = [aux_tensors[1][dsl_min(local_rows[r], mask.seqlen_q - 1)] for r in range(nrow)]

    for col in cutlass.range_constexpr(ncol):
        kv = col_base + t0ScS_mn[0, col][COL]
        kv_load = kv
        if const_expr(mask_seqlen):
            kv_load = dsl_min(kv, mask.seqlen_k - 1)
        firsts = []
        lasts = []
        for m in cutlass.range_constexpr(spec.intervals):
            packed = bounds[b, h, kv_load, m]
            firsts.append(Int32(packed))
            lasts.append(Int32(packed >> 32))
        for r in cutlass.range_constexpr(nrow):
            row = rows[r]
            visible = (firsts[0] <= row) & (row <= lasts[0])
            for m in cutlass.range_constexpr(1, spec.intervals):
                visible = visible | ((firsts[m] <= row) & (row <= lasts[m]))
            if const_expr(mask_seqlen):
                visible = visible & (local_rows[r] < mask.seqlen_q) & (kv < mask.seqlen_k)
            acc_S_mn[r, col] = acc_S_mn[r, col] if visible else -Float32.inf
