"""Triton FlashMask kernels: forward, dK/dV and dQ, reading only the column bounds and a block plan.

Layouts (last dim contiguous): q ``[B, Hq, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, DV]``,
o like q with DV, lse / delta ``[B, Hq, Nq]`` float32, fms / fme ``[Bm, Hm, Nk, M]`` int32,
pos ``[Nq]`` int32 global rows. The plan (see plan.py) lists, per program, runs of full tiles and
runs of partial tiles; skipped tiles are absent. Full tiles run without mask math; partial tiles
compare rows with the bounds in registers. Scores are kept in base 2 (``qk_scale = scale * log2 e``).

Pointer names: ``p_*`` are pointers, ``b_*`` are blocks in registers.
"""

import triton
import triton.language as tl

from fm_parallel.kernels.plan import ORDER_BUCKETS as _ORDER_BUCKETS

ORDER_BUCKETS = tl.constexpr(_ORDER_BUCKETS)  # the launch order's buckets (plan.launch_order)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _visible(fm_s, fm_e, b_pos, offs_n, Nk, M_INT: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Row b_pos sees key offs_n under any of the M intervals: [BLOCK_M, BLOCK_N] bool,
    or [BLOCK_N, BLOCK_M] when KEYS_FIRST (the dK/dV pass works on transposed tiles)."""
    in_range = offs_n < Nk
    if KEYS_FIRST:
        vis = tl.zeros([offs_n.shape[0], b_pos.shape[0]], dtype=tl.int1)
    else:
        vis = tl.zeros([b_pos.shape[0], offs_n.shape[0]], dtype=tl.int1)
    for m in tl.static_range(M_INT):
        lo = tl.load(fm_s + offs_n * M_INT + m, mask=in_range, other=2147483647)
        hi = tl.load(fm_e + offs_n * M_INT + m, mask=in_range, other=-1)
        if KEYS_FIRST:
            vis = vis | ((lo[:, None] <= b_pos[None, :]) & (b_pos[None, :] <= hi[:, None]))
        else:
            vis = vis | ((lo[None, :] <= b_pos[:, None]) & (b_pos[:, None] <= hi[None, :]))
    return vis


@triton.jit
def _fwd_tile(
    acc, m_i, l_i, b_q, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn, qk_scale,
    offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, M_INT: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr,
):
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    if WIDE:  # element offsets past 2^31 (see WIDE in the kernels)
        offs_n = offs_n.to(tl.int64)
    in_n = offs_n < Nk
    b_kt = tl.load(p_k + offs_n[None, :] * stride_kn + offs_d[:, None], mask=in_n[None, :] & (offs_d[:, None] < D), other=0.0)
    b_v = tl.load(p_v + offs_n[:, None] * stride_vn + offs_dv[None, :], mask=in_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        b_kt = b_kt.to(tl.float32)
        b_v = b_v.to(tl.float32)
    b_s = tl.dot(b_q, b_kt, input_precision=PREC) * qk_scale
    if MASKED:
        b_s = tl.where(_visible(fm_s, fm_e, b_pos, offs_n, Nk, M_INT, False), b_s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    # Rows that have seen nothing yet keep max -inf; shift by 0 there so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.math.exp2(b_s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _program_ids(ORDER, num_outer, WIDE: tl.constexpr):
    """This program's outer block and its batch x head entry, from the plan's launch order
    (``plan.launch_order``: buckets of visited tiles, heaviest first, each bucket entry by entry; the
    grid is one-dimensional, ``num_outer`` x entries programs). ``plan.launch_items`` is this decoding
    in Python. Widened to 64 bits when some tensor spans 2^31 elements or more (e.g. 32 heads x 1M
    tokens x 128)."""
    program = tl.program_id(0)
    entries = tl.num_programs(0) // num_outer
    bucket = 0
    for r in tl.static_range(1, ORDER_BUCKETS):  # the last bucket starting at or before this program
        bucket = tl.where(program >= tl.load(ORDER + num_outer + r) * entries, r, bucket)
    first = tl.load(ORDER + num_outer + bucket)
    width = tl.load(ORDER + num_outer + bucket + 1) - first  # > 0: this program lies in the bucket
    local = program - first * entries
    pid_bh = local // width
    block = tl.load(ORDER + first + local - pid_bh * width)
    if WIDE:
        block = block.to(tl.int64)
        pid_bh = pid_bh.to(tl.int64)
    return block, pid_bh


@triton.jit
def _query_program(ORDER, Hq, Hm, Bm, num_q_blocks, q_per_kv, q_per_mask_head, WIDE: tl.constexpr):
    """Who this program of a per-query-block pass (forward, dQ) is: its query block ``pid_m`` (plan
    launch order), ``pid_bh`` = batch x query head, the batch ``b``, query head ``h``, K/V head
    ``kvh``, mask batch row ``mb`` and mask head ``mh``, and its ``row`` in the launch plan."""
    pid_m, pid_bh = _program_ids(ORDER, num_q_blocks, WIDE)
    b = pid_bh // Hq
    h = pid_bh % Hq
    mb = b % Bm
    mh = h // q_per_mask_head
    return pid_m, pid_bh, b, h, h // q_per_kv, mb, mh, (mb * Hm + mh) * num_q_blocks + pid_m


@triton.jit
def flashmask_fwd_kernel(
    Q, K, V, O, LSE, FMS, FME, POS,
    FULL_OFF, FULL_RUNS, PART_OFF, PART_RUNS, ORDER,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    stride_mb, stride_mh,
    Nq, Nk, Hq, Hm, Bm, num_q_blocks, q_per_kv, q_per_mask_head, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_INT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    WIDE: tl.constexpr,
):
    pid_m, pid_bh, b, h, kvh, mb, mh, row = _query_program(ORDER, Hq, Hm, Bm, num_q_blocks, q_per_kv, q_per_mask_head, WIDE)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_m = offs_m < Nq
    p_q = Q + b * stride_qb + h * stride_qh
    b_q = tl.load(p_q + offs_m[:, None] * stride_qn + offs_d[None, :], mask=in_m[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    b_pos = tl.load(POS + offs_m, mask=in_m, other=-1)
    p_k = K + b * stride_kb + kvh * stride_kh
    p_v = V + b * stride_vb + kvh * stride_vh
    fm_s = FMS + mb * stride_mb + mh * stride_mh
    fm_e = FME + mb * stride_mb + mh * stride_mh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    r0 = tl.load(FULL_OFF + row)
    r1 = tl.load(FULL_OFF + row + 1)
    for r in range(r0, r1):
        kb0 = tl.load(FULL_RUNS + 2 * r)
        kb1 = tl.load(FULL_RUNS + 2 * r + 1)
        for kb in range(kb0, kb1):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, b_q, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn,
                                      qk_scale, offs_d, offs_dv, D, DV, BLOCK_N, M_INT, False, UPCAST, PREC, WIDE)
    r0 = tl.load(PART_OFF + row)
    r1 = tl.load(PART_OFF + row + 1)
    for r in range(r0, r1):
        kb0 = tl.load(PART_RUNS + 2 * r)
        kb1 = tl.load(PART_RUNS + 2 * r + 1)
        for kb in range(kb0, kb1):
            acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, b_q, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn,
                                      qk_scale, offs_d, offs_dv, D, DV, BLOCK_N, M_INT, True, UPCAST, PREC, WIDE)

    seen = l_i > 0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    b_lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    p_o = O + b * stride_ob + h * stride_oh
    tl.store(p_o + offs_m[:, None] * stride_on + offs_dv[None, :], b_o.to(O.dtype.element_ty), mask=in_m[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + pid_bh * Nq + offs_m, b_lse, mask=in_m)


@triton.jit
def _bwd_kv_tile(
    b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, POS, fm_s, fm_e, qb, offs_n, Nq, Nk,
    stride_qn, stride_don, qk_scale, offs_d, offs_dv,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, M_INT: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr,
):
    # Works on transposed tiles (keys x queries) so that no register tile needs a transpose:
    # only the loaded q block is read transposed.
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:
        offs_m = offs_m.to(tl.int64)
    in_m = offs_m < Nq
    b_qt = tl.load(p_q + offs_m[None, :] * stride_qn + offs_d[:, None], mask=in_m[None, :] & (offs_d[:, None] < D), other=0.0)
    b_do = tl.load(p_do + offs_m[:, None] * stride_don + offs_dv[None, :], mask=in_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        b_qt = b_qt.to(tl.float32)
        b_do = b_do.to(tl.float32)
    # lse is +inf (not -inf) for padding rows and rows that see nothing, so their probabilities are 0.
    b_lse = tl.load(p_lse + offs_m, mask=in_m, other=float("inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    b_delta = tl.load(p_delta + offs_m, mask=in_m, other=0.0)
    b_st = tl.dot(b_k, b_qt, input_precision=PREC) * qk_scale
    b_pt = tl.math.exp2(b_st - b_lse[None, :])
    if MASKED:
        b_pos = tl.load(POS + offs_m, mask=in_m, other=-1)
        b_pt = tl.where(_visible(fm_s, fm_e, b_pos, offs_n, Nk, M_INT, True), b_pt, 0.0)
    b_dv += tl.dot(b_pt.to(b_do.dtype), b_do, input_precision=PREC)
    b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    b_dk += tl.dot(b_dst.to(b_qt.dtype), tl.trans(b_qt), input_precision=PREC)
    return b_dk, b_dv


@triton.jit
def flashmask_bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_OUT, FMS, FME, POS,
    FULL_OFF, FULL_RUNS, PART_OFF, PART_RUNS, ORDER,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh,
    Nq, Nk, Hq, Hkv, Hm, Bm, num_k_blocks, q_per_kv, q_per_mask_head, qk_scale, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_INT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    WIDE: tl.constexpr,
):
    pid_n, pid_bh = _program_ids(ORDER, num_k_blocks, WIDE)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    mb = b % Bm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_n = offs_n < Nk
    b_k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                  mask=in_n[:, None] & (offs_d[None, :] < D), other=0.0)
    b_v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :],
                  mask=in_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Every query head of this K/V head contributes (GQA without copying K/V).
    for g in range(q_per_kv):
        h = kvh * q_per_kv + g
        mh = h // q_per_mask_head
        row = (mb * Hm + mh) * num_k_blocks + pid_n
        p_q = Q + b * stride_qb + h * stride_qh
        p_do = DO + b * stride_dob + h * stride_doh
        p_lse = LSE + (b * Hq + h) * Nq
        p_delta = DELTA + (b * Hq + h) * Nq
        fm_s = FMS + mb * stride_mb + mh * stride_mh
        fm_e = FME + mb * stride_mb + mh * stride_mh
        r0 = tl.load(FULL_OFF + row)
        r1 = tl.load(FULL_OFF + row + 1)
        for r in range(r0, r1):
            qb0 = tl.load(FULL_RUNS + 2 * r)
            qb1 = tl.load(FULL_RUNS + 2 * r + 1)
            for qb in range(qb0, qb1):
                b_dk, b_dv = _bwd_kv_tile(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, POS, fm_s, fm_e, qb,
                                          offs_n, Nq, Nk, stride_qn, stride_don, qk_scale,
                                          offs_d, offs_dv, D, DV, BLOCK_M, M_INT, False, UPCAST, PREC, WIDE)
        r0 = tl.load(PART_OFF + row)
        r1 = tl.load(PART_OFF + row + 1)
        for r in range(r0, r1):
            qb0 = tl.load(PART_RUNS + 2 * r)
            qb1 = tl.load(PART_RUNS + 2 * r + 1)
            for qb in range(qb0, qb1):
                b_dk, b_dv = _bwd_kv_tile(b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, POS, fm_s, fm_e, qb,
                                          offs_n, Nq, Nk, stride_qn, stride_don, qk_scale,
                                          offs_d, offs_dv, D, DV, BLOCK_M, M_INT, True, UPCAST, PREC, WIDE)
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             (b_dk * scale).to(DK.dtype.element_ty), mask=in_n[:, None] & (offs_d[None, :] < D))
    tl.store(DV_OUT + b * stride_dvb + kvh * stride_dvh + offs_n[:, None] * stride_dvn + offs_dv[None, :],
             b_dv.to(DV_OUT.dtype.element_ty), mask=in_n[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_q_tile(
    b_dq, b_q, b_do, b_lse, b_delta, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn, qk_scale,
    offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, M_INT: tl.constexpr,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr,
):
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    if WIDE:  # element offsets past 2^31 (see WIDE in the kernels)
        offs_n = offs_n.to(tl.int64)
    in_n = offs_n < Nk
    b_k = tl.load(p_k + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_n[:, None] & (offs_d[None, :] < D), other=0.0)
    b_v = tl.load(p_v + offs_n[:, None] * stride_vn + offs_dv[None, :], mask=in_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        b_k = b_k.to(tl.float32)
        b_v = b_v.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * qk_scale
    b_p = tl.math.exp2(b_s - b_lse[:, None])
    if MASKED:
        b_p = tl.where(_visible(fm_s, fm_e, b_pos, offs_n, Nk, M_INT, False), b_p, 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    b_ds = b_p * (b_dp - b_delta[:, None])
    b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    return b_dq


@triton.jit
def flashmask_bwd_q_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, FMS, FME, POS,
    FULL_OFF, FULL_RUNS, PART_OFF, PART_RUNS, ORDER,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn, stride_mb, stride_mh,
    Nq, Nk, Hq, Hm, Bm, num_q_blocks, q_per_kv, q_per_mask_head, qk_scale, scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_INT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    WIDE: tl.constexpr,
):
    pid_m, pid_bh, b, h, kvh, mb, mh, row = _query_program(ORDER, Hq, Hm, Bm, num_q_blocks, q_per_kv, q_per_mask_head, WIDE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_m = offs_m < Nq
    b_q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                  mask=in_m[:, None] & (offs_d[None, :] < D), other=0.0)
    b_do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_dv[None, :],
                   mask=in_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
        b_do = b_do.to(tl.float32)
    b_lse = tl.load(LSE + pid_bh * Nq + offs_m, mask=in_m, other=float("inf"))
    b_lse = tl.where(b_lse == float("-inf"), float("inf"), b_lse * 1.4426950408889634)
    b_delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=in_m, other=0.0)
    b_pos = tl.load(POS + offs_m, mask=in_m, other=-1)
    p_k = K + b * stride_kb + kvh * stride_kh
    p_v = V + b * stride_vb + kvh * stride_vh
    fm_s = FMS + mb * stride_mb + mh * stride_mh
    fm_e = FME + mb * stride_mb + mh * stride_mh
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    r0 = tl.load(FULL_OFF + row)
    r1 = tl.load(FULL_OFF + row + 1)
    for r in range(r0, r1):
        kb0 = tl.load(FULL_RUNS + 2 * r)
        kb1 = tl.load(FULL_RUNS + 2 * r + 1)
        for kb in range(kb0, kb1):
            b_dq = _bwd_q_tile(b_dq, b_q, b_do, b_lse, b_delta, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn,
                               qk_scale, offs_d, offs_dv, D, DV, BLOCK_N, M_INT, False, UPCAST, PREC, WIDE)
    r0 = tl.load(PART_OFF + row)
    r1 = tl.load(PART_OFF + row + 1)
    for r in range(r0, r1):
        kb0 = tl.load(PART_RUNS + 2 * r)
        kb1 = tl.load(PART_RUNS + 2 * r + 1)
        for kb in range(kb0, kb1):
            b_dq = _bwd_q_tile(b_dq, b_q, b_do, b_lse, b_delta, b_pos, p_k, p_v, fm_s, fm_e, kb, Nk, stride_kn, stride_vn,
                               qk_scale, offs_d, offs_dv, D, DV, BLOCK_N, M_INT, True, UPCAST, PREC, WIDE)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqn + offs_d[None, :],
             (b_dq * scale).to(DQ.dtype.element_ty), mask=in_m[:, None] & (offs_d[None, :] < D))


@triton.jit
def flashmask_bwd_delta_kernel(
    O, DO, DLSE, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
    Nq, Hq, HAS_DLSE: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The backward's preprocess, ``delta = rowsum(dO * O) - dlse`` ``[B, Hq, Nq]`` float32, reading
    O and dO once in their own dtype (as torch ops it wrote three float32 copies: 370 us against 48 us
    at 16 heads x 16k x 128 on the H200, launch/bench/triton_bwd.py at 7092618)."""
    pid_m = tl.program_id(0)
    # 64-bit offsets always: a memory-bound pass pays nothing for them, and O / dO may span 2^31
    # elements (32 heads x 1M tokens x 128), past which 32-bit offsets would wrap.
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_m = offs_m < Nq
    ld = in_m[:, None] & (offs_dv[None, :] < DV)
    b_o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_dv[None, :], mask=ld, other=0.0)
    b_do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_dv[None, :], mask=ld, other=0.0)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)
    if HAS_DLSE:
        b_delta -= tl.load(DLSE + pid_bh * Nq + offs_m, mask=in_m, other=0.0)
    tl.store(DELTA + pid_bh * Nq + offs_m, b_delta, mask=in_m)
