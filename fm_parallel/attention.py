"""``flashmask_attention``: the drop-in replacement for ``F.scaled_dot_product_attention(attn_mask=dense)``.

This module owns input checks, the choice of implementation and the dense fallback; the
computations live in :mod:`fm_parallel.reference` (PyTorch), :mod:`fm_parallel.dense` and, on GPUs,
:mod:`fm_parallel.kernels`.
"""

from __future__ import annotations

import functools
import math

import torch

from fm_parallel import backends
from fm_parallel.masks import builders
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.masks.intervals import MaskNotExpressible
from fm_parallel.reference import DEFAULT_BLOCK

__all__ = ["flashmask_attention", "IMPLS"]

IMPLS = backends.names()  # ("auto", "cute", "triton", "torch", "dense")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor [B, H, N, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [B, H, N, D] (SDPA layout), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected one of float16, bfloat16, float32, float64, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected the device of q ({q.device}), got {t.device}")
        if 0 in t.shape:
            raise ValueError(f"{name}: expected no empty dimension, got shape {tuple(t.shape)}")
    b, hq, nq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k, v: expected batch {b} like q, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head dim {d} like q, got {k.shape[-1]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v: expected heads and length {tuple(k.shape[1:3])} like k, got {tuple(v.shape[1:3])}")
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"k: expected a number of heads dividing q's {hq} (grouped-query attention), got {hkv}")
    return b, hq, nq, hkv, k.shape[2]


# The last query row: rows are int32 and a mask covering row r has num_rows = r + 1 <= 2^31 - 1.
_LAST_ROW = 2**31 - 2


def _positions(nq: int, q_offset, q_positions, device) -> torch.Tensor:
    if q_positions is not None:
        if not isinstance(q_offset, int) or q_offset != 0:
            raise ValueError(f"q_offset: expected 0 when q_positions is given, got {q_offset!r}")
        if (not isinstance(q_positions, torch.Tensor) or q_positions.dtype.is_floating_point
                or q_positions.dtype.is_complex or q_positions.dtype == torch.bool):
            got = q_positions.dtype if isinstance(q_positions, torch.Tensor) else type(q_positions).__name__
            raise ValueError(f"q_positions: expected an integer tensor [{nq}], got {got}")
        if q_positions.shape != (nq,):
            raise ValueError(f"q_positions: expected shape [{nq}] (one row per query), got {tuple(q_positions.shape)}")
        pos = q_positions.to(device=device, dtype=torch.int64)
        low, high = torch.aminmax(pos)
        if int(low) < 0 or int(high) > _LAST_ROW:
            raise ValueError(
                f"q_positions: expected rows in [0, {_LAST_ROW}] (int32 rows, num_rows = last row + 1), "
                f"got [{int(low)}, {int(high)}]"
            )
        return pos.to(torch.int32)
    if not isinstance(q_offset, int) or isinstance(q_offset, bool) or q_offset < 0:
        raise ValueError(f"q_offset: expected an int >= 0, got {q_offset!r}")
    if q_offset + nq - 1 > _LAST_ROW:
        raise ValueError(
            f"q_offset: expected q_offset + Nq - 1 <= {_LAST_ROW} (int32 rows, num_rows = last row + 1), "
            f"got q_offset={q_offset} with Nq={nq} (last row {q_offset + nq - 1})"
        )
    if torch.compiler.is_compiling():
        return torch.arange(q_offset, q_offset + nq, device=device, dtype=torch.int32)
    return _consecutive_rows(q_offset, nq, device)


@functools.lru_cache(maxsize=64)
def _consecutive_rows(q_offset: int, nq: int, device: torch.device) -> torch.Tensor:
    """The rows of an offset slice, made once per (offset, length, device): every layer of a step
    asks for the same ones, and a launch saved is host time saved when kernels are short. Read only."""
    return torch.arange(q_offset, q_offset + nq, device=device, dtype=torch.int32)


def _check_mask(mask: FlashMask, b, hq, hkv, nk, device, last_row: int) -> None:
    if mask.batch not in (1, b):
        raise ValueError(f"mask: expected batch 1 or {b}, got {mask.batch}")
    if mask.heads not in (1, hkv, hq):
        raise ValueError(f"mask: expected 1, H_kv={hkv} or H_q={hq} heads, got {mask.heads}")
    if mask.num_keys != nk:
        raise ValueError(f"mask: expected {nk} key columns (the length of k), got {mask.num_keys}")
    if mask.device != device:
        raise ValueError(f"mask: expected device {device} like q, got {mask.device}")
    if last_row >= mask.num_rows:
        raise ValueError(
            f"q_offset/q_positions: expected query rows < the mask's num_rows {mask.num_rows}, got row {last_row}"
        )


def _dense_mask(attn_mask, b, hq, hkv, nq, nk, device) -> torch.Tensor:
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected a tensor [Nq, Nk] or [B, H, Nq, Nk], got {type(attn_mask).__name__}")
    m = attn_mask.view(1, 1, *attn_mask.shape) if attn_mask.dim() == 2 else attn_mask
    if m.dim() != 4 or m.shape[-2:] != (nq, nk) or m.shape[0] not in (1, b) or m.shape[1] not in (1, hkv, hq):
        raise ValueError(
            f"attn_mask: expected [{nq}, {nk}] or [1|{b}, 1|{hkv}|{hq}, {nq}, {nk}], got {tuple(attn_mask.shape)}"
        )
    if m.device != device:
        raise ValueError(f"attn_mask: expected device {device} like q, got {m.device}")
    if m.dtype != torch.bool and not m.dtype.is_floating_point:
        raise ValueError(f"attn_mask: expected bool (True = visible) or additive float, got {m.dtype}")
    return m


def autocast_inputs(q, k, v):
    """q, k, v as autocast casts an op's inputs when it is on for their device (SDPA runs in the lower
    precision under autocast): floating tensors to the autocast dtype, except float64 ones, which
    autocast never touches (a float64 model under ``bf16`` autocast runs SDPA in float64); unchanged
    when autocast is off."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v
    kind = q.device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return q, k, v
    if not enabled:
        return q, k, v
    dtype = torch.get_autocast_dtype(kind)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t for t in (q, k, v))


def flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fms: torch.Tensor | None = None,
    fme: torch.Tensor | None = None,
    *,
    mask: FlashMask | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    q_positions: torch.Tensor | None = None,
    impl: str = "auto",
    return_lse: bool = False,
    block_size: int = DEFAULT_BLOCK,
    deterministic: bool = False,
):
    """Attention under a FlashMask, in SDPA layout.

    Args:
        q: ``[B, Hq, Nq, D]``; k: ``[B, Hkv, Nk, D]``; v: ``[B, Hkv, Nk, Dv]``, ``Hq % Hkv == 0``;
            float16 / bfloat16 / float32 (float64 on the PyTorch paths).
        fms, fme: column bounds ``[B|1, Hm, Nk]`` or ``[B|1, Hm, Nk, M]`` (``Hm`` in ``{1, Hkv, Hq}``,
            ``M <= 4``): key ``j`` is visible to rows ``fms[..., j, m] <= i <= fme[..., j, m]``.
        mask: a :class:`FlashMask` instead of ``fms``/``fme``.
        attn_mask: a dense SDPA-style mask instead (bool, True = visible, or additive float);
            compressed with :func:`fm_parallel.masks.from_dense`, or run densely (logged once) when it
            is not expressible. With none of the four the attention is unmasked.
        is_causal: the causal mask (like SDPA, with no other mask).
        scale: softmax scale, default ``1 / sqrt(D)``.
        q_offset: global row of the first query when ``q`` is a slice of the sequence.
        q_positions: ``[Nq]`` global row of each query instead (zigzag shards).
        impl: ``"auto"`` (on CUDA the first of ``AUTO_ORDER_CUDA`` that is installed, runs on the
            device and takes the inputs: CuTe on Hopper with flash-attn-4, else Triton; elsewhere the
            PyTorch path), ``"cute"``
            (FlashAttention-4's kernels, Hopper, the ``[cute]`` extra), ``"triton"``, ``"torch"`` or
            ``"dense"``. An explicit choice is honoured or raises, saying what is missing.
        return_lse: also return the log-sum-exp ``[B, Hq, Nq]`` float32 (natural log).
        block_size: tile size of the PyTorch path.
        deterministic: require a backward that is reproducible bit for bit. The Triton and PyTorch
            paths always are; the CuTe path is not (FA4 adds dQ with atomics on Hopper), so with True
            ``impl="auto"`` picks Triton and ``impl="cute"`` raises.
    Returns:
        ``out [B, Hq, Nq, Dv]`` in q's dtype (and ``lse``). Rows that see no key give 0 (lse -inf)
        and no NaN in any gradient. Under ``torch.autocast`` q, k, v are cast to the autocast dtype
        first and the output is in it, as SDPA does (differentiably: gradients reach the originals).
    """
    q, k, v = autocast_inputs(q, k, v)
    b, hq, nq, hkv, nk = _check_qkv(q, k, v)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    block_size = builders.check_int("block_size", block_size, low=1)
    is_causal = builders.check_bool("is_causal", is_causal)
    return_lse = builders.check_bool("return_lse", return_lse)
    if (fms is None) != (fme is None):
        raise ValueError("fms, fme: expected both or neither, got only " + ("fms" if fme is None else "fme"))
    sources = [n for n, given in (("fms/fme", fms is not None), ("mask", mask is not None),
                                  ("attn_mask", attn_mask is not None), ("is_causal", bool(is_causal))) if given]
    if len(sources) > 1:
        raise ValueError(f"mask: expected at most one of fms/fme, mask, attn_mask, is_causal, got {sources}")
    deterministic = builders.check_bool("deterministic", deterministic)
    # One resolver for every entry point (fm_parallel/backends.py): auto skips backends that cannot take
    # these dtypes or head dims; an explicit name runs or raises.
    impl = backends.resolve(impl, q.device, q.dtype, d, v.shape[-1], deterministic)

    dense_rows = None
    if attn_mask is not None:
        if q_positions is not None or q_offset != 0:
            raise ValueError("q_offset/q_positions: a dense attn_mask already gives every local row; pass neither")
        dense = _dense_mask(attn_mask, b, hq, hkv, nq, nk, q.device)
        try:
            mask = builders.from_dense(dense)
        except MaskNotExpressible as e:
            backends.log_once(
                f"dense:{e}",
                f"fm_parallel: attn_mask is not expressible as a FlashMask ({e}); "
                "running chunked dense attention instead (slower, O(N^2) mask memory)",
            )
            impl, dense_rows = "dense", (lambda r0, r1: dense[:, :, r0:r1])
    positions = _positions(nq, q_offset, q_positions, q.device)
    # The last row is known without a device sync unless explicit positions were given.
    last_row = int(positions.max()) if q_positions is not None else q_offset + nq - 1
    if mask is None and dense_rows is None:
        if fms is not None:
            mask = FlashMask(fms, fme, max(nk, last_row + 1))
        elif is_causal:  # SDPA's alignment: top-left, so rows past the last key see every key
            mask = builders.causal(nk, max(nk, last_row + 1)).to(q.device)
        else:
            mask = builders.full(nk, max(nk, last_row + 1)).to(q.device)
    if mask is not None:
        if not isinstance(mask, FlashMask):
            raise ValueError(f"mask: expected a FlashMask, got {type(mask).__name__}")
        _check_mask(mask, b, hq, hkv, nk, q.device, last_row)

    offset = q_offset if q_positions is None else None  # lets the backend cache its launch plan
    extra = {"block_size": block_size} if impl == "torch" else {}
    if dense_rows is not None:  # a mask no FlashMask expresses: only the dense backend takes one
        extra["mask_rows"] = dense_rows
    out, lse = backends.get(impl).attention(q, k, v, mask, positions, scale, offset, deterministic, **extra)
    return (out, lse) if return_lse else out
