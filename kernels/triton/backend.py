"""Launchers and autograd for the Triton FlashMask kernels (``impl="triton"``).

``attention(q, k, v, mask, positions, scale)`` is the backend entry point used by
``fm_parallel.flashmask_attention``; ``flashmask_fwd`` / ``flashmask_bwd`` are the launchers that
the distributed wrappers call directly with their own merge logic. Block plans are built from the
shared tile rule (plan.py) once per mask, block shape and query offset, and kept in this backend's store
(:func:`fm_parallel.derived.derived_for_mask`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from fm_parallel.derived import derived_for_mask
from fm_parallel.kernels.custom_op import define_attention_op
from fm_parallel.kernels.plan import BlockSparsePlan, build_plan, build_plans_consecutive
from fm_parallel.kernels.triton.kernels import (
    LOG2E,
    flashmask_bwd_delta_kernel,
    flashmask_bwd_kv_kernel,
    flashmask_bwd_q_kernel,
    flashmask_fwd_kernel,
)
from fm_parallel.masks.flashmask import FlashMask

# What this backend derives from masks: launch plans per block shape and row offset.
_DERIVED = derived_for_mask("triton")

__all__ = ["attention", "forward", "backward", "flashmask_fwd", "flashmask_bwd", "unsupported_inputs", "KernelConfig", "config_for"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Hopper (H200) block shapes per pass and head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages).
# D=128 from launch/bench/tune_triton.py (docs/benchmarks/tune_triton.json: 64 x 64 tiles won every
# pass on causal and packed-document masks at 16k); D=64 and 256 not swept yet.
_HOPPER = {
    "fwd": {64: KernelConfig(64, 64, 4, 3), 128: KernelConfig(64, 64, 4, 3), 256: KernelConfig(64, 64, 8, 2)},
    "bwd_kv": {64: KernelConfig(64, 64, 4, 2), 128: KernelConfig(64, 64, 4, 2), 256: KernelConfig(32, 64, 8, 2)},
    "bwd_q": {64: KernelConfig(64, 64, 4, 2), 128: KernelConfig(64, 64, 4, 2), 256: KernelConfig(64, 32, 8, 2)},
}
# The interpreter runs one fixed, small config (autotuning does not work there).
_INTERPRET = KernelConfig(32, 32, 4, 1)


def config_for(kind: str, head_dim: int) -> KernelConfig:
    if _interpreting():
        return _INTERPRET
    table = _HOPPER[kind]
    return table[min((d for d in table if d >= head_dim), default=max(table))]


def _plan(mask: FlashMask, positions: torch.Tensor, cfg: KernelConfig, transposed: bool, q_offset: int | None):
    """The launch plan for one pass. Both orientations come from one tile classification and are
    cached together, so the forward, dK/dV and dQ passes classify once per mask and block shape."""
    if q_offset is None:  # arbitrary positions: no cheap key to cache on
        return build_plan(mask, positions, cfg.block_m, cfg.block_n, transposed)
    # Consecutive rows: the range-based builder, O(N / block) instead of classifying every tile.
    key = ("triton_plans", cfg.block_m, cfg.block_n, q_offset, positions.numel())
    make = lambda: build_plans_consecutive(mask, q_offset, positions.numel(), cfg.block_m, cfg.block_n)  # noqa: E731
    return _DERIVED.get((mask,), key, make)[int(transposed)]


def _span(t: torch.Tensor) -> int:
    """One past the largest element offset of ``t`` (its storage extent for a strided view)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)


def _meta(q, v, mask: FlashMask, *others: torch.Tensor):
    b, hq, nq, d = q.shape
    hkv, nk = v.shape[1], v.shape[2]
    return dict(
        Nq=nq, Nk=nk, Hq=hq, Hm=mask.heads, Bm=mask.batch,
        q_per_kv=hq // hkv, q_per_mask_head=hq // mask.heads,
        D=d, DV=v.shape[-1], BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(v.shape[-1]),
        M_INT=mask.max_intervals, UPCAST=_interpreting(),
        # 64-bit offsets only where some tensor spans 2^31 elements (32 heads x 1M tokens x 128 does):
        # the usual sizes keep the cheaper 32-bit address arithmetic.
        WIDE=max(_span(t) for t in (q, v, *others)) > 2**31,
        # float32 inputs get full-precision dots (Triton's default would be TF32); halves ignore it.
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    # The interpreter truncates float32 -> bfloat16 stores instead of rounding (twice the error):
    # there, kernels write float32 and torch rounds afterwards.
    return torch.float32 if _interpreting() and dtype == torch.bfloat16 else dtype


def _plan_args(plan: BlockSparsePlan):
    return plan.full_offsets, plan.full_runs, plan.part_offsets, plan.part_runs, plan.order


def flashmask_fwd(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, q_offset: int | None = None):
    """Forward launcher. Returns ``out [B, Hq, Nq, DV]`` (q's dtype) and ``lse [B, Hq, Nq]`` float32."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    b, hq, nq, _ = q.shape
    cfg = config_for("fwd", q.shape[-1])
    plan = _plan(mask, positions, cfg, False, q_offset)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=_buffer_dtype(q.dtype), device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    pos = positions.to(torch.int32)
    grid = (plan.num_outer * b * hq,)  # one program per (block, batch x head), in the plan's launch order
    flashmask_fwd_kernel[grid](
        q, k, v, out, lse, mask.fms, mask.fme, pos, *_plan_args(plan),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        mask.fms.stride(0), mask.fms.stride(1),
        num_q_blocks=plan.num_outer, qk_scale=scale * LOG2E,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_meta(q, v, mask, k, out),
    )
    return out.to(q.dtype), lse


def _delta(out, dout, dlse):
    """Backward preprocess: ``rowsum(dO * O) - dlse``, ``[B, Hq, Nq]`` float32 (d lse_i / d s_ij =
    p_ij folds the lse's gradient into the same correction). ``out`` / ``dout``: last dim contiguous."""
    b, hq, nq, dv = out.shape
    delta = torch.empty(b, hq, nq, dtype=torch.float32, device=out.device)
    dlse = None if dlse is None else dlse.float().expand(b, hq, nq).contiguous()
    if delta.numel() == 0:
        return delta
    block_m = 16 if _interpreting() else 64
    flashmask_bwd_delta_kernel[(triton.cdiv(nq, block_m), b * hq)](
        out, dout, delta if dlse is None else dlse, delta, *out.stride()[:3], *dout.stride()[:3], nq, hq,
        HAS_DLSE=dlse is not None, DV=dv, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_M=block_m,
    )
    return delta


def bwd_kv(q, k, v, dout, lse, delta, mask: FlashMask, positions, scale, q_offset=None):
    """dK, dV: one program per key block, looping over the query blocks that see it (all query heads of
    its KV head)."""
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    dk = torch.empty_like(k, dtype=_buffer_dtype(k.dtype))
    dv = torch.empty_like(v, dtype=_buffer_dtype(v.dtype))
    cfg = config_for("bwd_kv", d)
    plan = _plan(mask, positions, cfg, True, q_offset)
    flashmask_bwd_kv_kernel[(plan.num_outer * b * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, mask.fms, mask.fme,
        positions.to(torch.int32), *_plan_args(plan),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3],
        mask.fms.stride(0), mask.fms.stride(1),
        Hkv=hkv, num_k_blocks=plan.num_outer, qk_scale=scale * LOG2E, scale=scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_meta(q, v, mask, k, dout, dk, dv),
    )
    return dk.to(k.dtype), dv.to(v.dtype)


def bwd_q(q, k, v, dout, lse, delta, mask: FlashMask, positions, scale, q_offset=None):
    """dQ: a separate pass over the forward's tiles (deterministic: no atomics)."""
    b, hq, nq, d = q.shape
    dq = torch.empty_like(q, dtype=_buffer_dtype(q.dtype))
    cfg = config_for("bwd_q", d)
    plan = _plan(mask, positions, cfg, False, q_offset)
    flashmask_bwd_q_kernel[(plan.num_outer * b * hq,)](
        q, k, v, dout, lse, delta, dq, mask.fms, mask.fme, positions.to(torch.int32), *_plan_args(plan),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
        *dq.stride()[:3], mask.fms.stride(0), mask.fms.stride(1),
        num_q_blocks=plan.num_outer, qk_scale=scale * LOG2E, scale=scale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_meta(q, v, mask, k, dout, dq),
    )
    return dq.to(q.dtype)


def flashmask_bwd(q, k, v, out, lse, dout, mask: FlashMask, positions, scale, dlse=None, q_offset=None,
                  deterministic: bool = True):
    """Backward launcher: ``(dq, dk, dv)`` in the inputs' dtypes. ``dlse``: gradient of the lse output.

    Always bitwise reproducible (``deterministic`` is accepted for the shared launcher interface): dQ
    has its own pass. Adding dQ with float32 atomics inside the dK/dV pass instead was measured on the
    H200 and removed: 5.5x slower forward+backward (causal 16k: 54.1 vs 9.9 ms; packed docs 10.4 vs
    2.4 ms; launch/bench/kernel.py, 2026-12-03), the element-wise atomics cost far more than the
    recomputation of QK^T they save. Both passes in one launch (FlexAttention's layout: the dQ
    programs start while the last dK/dV ones finish) was measured and removed too: within 2% on packed
    docs, DPO and the sliding window, 5% slower on prefix-LM (16k, launch/bench/triton_bwd.py at 7092618,
    2026-12-03); the heaviest-first launch order already leaves each pass little tail to overlap.
    Reading the looped-over tiles through TMA tensor descriptors (commit 2fff1e8) was measured and
    removed as well: forward 19-63% slower, backward within 1% at 16k (DPO 4% faster) and mixed at 64k
    (DPO and prefix-LM 7-9% faster, packed docs and the sliding window 3% slower; one repeat at 64k).
    """
    q, k, v, out, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, out, dout))
    delta, lse = _delta(out, dout, dlse), lse.contiguous()
    dk, dv = bwd_kv(q, k, v, dout, lse, delta, mask, positions, scale, q_offset)
    return bwd_q(q, k, v, dout, lse, delta, mask, positions, scale, q_offset), dk, dv


# Registered as torch.library custom ops (fm_parallel/kernels/custom_op.py): no graph breaks under torch.compile,
# and a new mask is new data, never a new graph.
attention = define_attention_op("flashmask", flashmask_fwd, flashmask_bwd)
# The launcher names of the backend interface (fm_parallel/backends.py).
forward, backward = flashmask_fwd, flashmask_bwd


def unsupported_inputs(dtype: torch.dtype, head_dim: int | None, value_dim: int | None) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"q: impl='triton' expects float16, bfloat16 or float32, got {dtype}"
    return None
