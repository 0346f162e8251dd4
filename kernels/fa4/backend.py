"""FlashMask on FlashAttention-4's CuTe DSL kernels (``impl="cute"``, Hopper).

FA4 (the ``[cute]`` extra, the version :mod:`.pin` names) takes two things from us: block-sparsity lists
(which key tiles each query tile visits, and which of them need masking; :mod:`.sparsity`,
built from the same tile rule as the Triton plans) and a ``mask_mod`` that evaluates the FlashMask
inside partial tiles from the column bounds (:mod:`.mask_mod`). Fully visible tiles run
FA4's unmasked path; skipped tiles are never loaded.

Masks that are plain causal or packed causal documents over whole sequences, and say so without a
sync (:meth:`FlashMask.causal_documents`), run FA4's own causal / varlen kernels instead: the
strongest kernels for those masks, so the backend is never behind them (``_dense_path``).

Layouts: our tensors are SDPA's ``[B, H, N, D]``; FA4's are ``[B, N, H, D]``. Both are passed as
transposed views (FA4 only needs the last dimension contiguous), so nothing is copied.

``attention`` is the entry point of ``flashmask_attention(impl="cute")`` (a ``torch.library``
custom op with a fake implementation, like the Triton backend); ``cute_fwd`` / ``cute_bwd`` are the
launchers the ring and Ulysses wrappers call with their merged output and log-sum-exp.

The FA4 functions used are its private ``_flash_attn_fwd`` / ``_flash_attn_bwd``: the public
``flash_attn_func`` has no way to pass a merged lse (and its gradient) into the backward, which the
ring needs. The version is pinned for that reason.
"""

from __future__ import annotations

import collections
import functools
import itertools

import torch
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

from fm_parallel.derived import derived_for_mask
from fm_parallel.kernels.fa4 import launches as fa4_launches
from fm_parallel.kernels.fa4 import patches as fa4_patches
from fm_parallel.kernels.custom_op import define_attention_op
from fm_parallel.kernels.fa4.mask_mod import flashmask_mask_mod
from fm_parallel.kernels.fa4.sparsity import (cost_order, fa4_block_sparsity, fa4_block_sparsity_consecutive,
                                              fa4_tile_shape, pack_bounds)
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["attention", "forward", "backward", "cute_fwd", "cute_bwd", "paths", "supports", "unsupported_inputs"]

_DTYPES = (torch.float16, torch.bfloat16)

fa4_patches.install()
# What the FA4 changes of :mod:`.patches` apply to our kernels (a benchmark may switch them
# off to measure them; each setting compiles its own kernels).
OPTIONS = fa4_patches.Options()
# What this backend derives from masks (block lists, packed bounds, cu_seqlens, recorded launches).
_DERIVED = derived_for_mask("fa4")


@functools.lru_cache(maxsize=None)
def supports(device: torch.device) -> bool:
    """Hopper (compute capability 9.x): the tile shapes of :func:`fa4_tile_shape` are FA4's SM90 ones."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def unsupported_inputs(dtype: torch.dtype, head_dim: int | None, value_dim: int | None) -> str | None:
    """Why FA4's SM90 kernels cannot run these inputs (``impl="auto"`` then uses Triton), or None."""
    if dtype not in _DTYPES:
        return f"q: impl='cute' expects float16 or bfloat16, got {dtype}"
    for name, dim in (("q", head_dim), ("v", value_dim)):
        if dim is not None and (dim % 8 or not 8 <= dim <= 256):
            return f"{name}: impl='cute' expects a head dim in [8, 256] divisible by 8, got {dim}"
    return None



def _bshd(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> FA4's ``[B, N, H, D]`` as a view (a copy only if D is not contiguous)."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _sparsity(mask: FlashMask, positions: torch.Tensor, num_heads: int, head_dim: int, q_offset: int | None):
    """FA4's (forward, backward) block-sparse tensors and, for the cost-ordered schedule (the default
    :data:`OPTIONS`), each pass's CTA order (``None`` otherwise); cached per mask (this backend's store) for consecutive rows."""
    block_q, block_k = fa4_tile_shape(head_dim)
    ordered = OPTIONS.schedule == "cost" and fa4_patches.install()  # unpatched FA4 would not read it

    def finish(fwd, bwd):
        orders = (cost_order(fwd), cost_order(bwd)) if ordered else (None, None)
        return fwd.to_fa4(), bwd.to_fa4(), *orders

    if q_offset is None:  # arbitrary rows (zigzag shards): the dense tile grid, no cheap cache key
        return finish(*fa4_block_sparsity(mask, block_q, block_k, num_heads, positions))

    def make():  # consecutive rows: the lists built on the GPU from the tile ranges
        return finish(*fa4_block_sparsity_consecutive(mask, block_q, block_k, num_heads, q_offset, positions.numel()))

    key = ("fa4_sparsity", block_q, block_k, num_heads, q_offset, positions.numel(), ordered)
    return _DERIVED.get((mask,), key, make)


def _mask_args(mask: FlashMask, positions: torch.Tensor, num_heads: int, q_offset: int | None,
               order: torch.Tensor | None):
    """The ``mask_mod`` and its auxiliary tensors: bounds packed in int64 and, for consecutive rows,
    shifted by the offset (one load per score and interval); for arbitrary rows, also the rows; last,
    the pass's CTA order when the schedule is cost-ordered."""
    explicit = q_offset is None
    mask_mod = flashmask_mask_mod(mask.batch == 1, num_heads // mask.heads, mask.max_intervals, explicit, OPTIONS)
    offset = 0 if explicit else q_offset
    bounds = _DERIVED.get((mask,), ("fa4_bounds", offset), lambda: pack_bounds(mask.fms, mask.fme, offset))
    aux = [bounds, positions.to(torch.int32).contiguous()] if explicit else [bounds]
    return mask_mod, aux if order is None else [*aux, order]


# How many calls took each path (counted on the host; tests and verify_gpu.py read it).
paths: collections.Counter = collections.Counter()


def _dense_path(mask: FlashMask, q: torch.Tensor, k: torch.Tensor, q_offset: int | None):
    """FA4's own kernel for masks it has one for, or None (block sparsity + mask_mod).

    Plain causal (one document) runs FA4's causal kernel, any batch; packed causal documents run its
    varlen kernel with ``cu_seqlens`` (one batch row: [N, H, D] is then a view of our layout). These
    are the strongest kernels for those masks (block lists of packed documents leave more partial
    tiles and the block-sparse loop costs more per tile, docs/benchmarks/README.md). Only whole
    sequences qualify (row offset 0, ``Nq == Nk == num_rows``), and only masks that know their
    structure without a sync (:meth:`FlashMask.causal_documents`: built on the CPU, moved by ``to``)."""
    if q_offset != 0 or not q.shape[2] == k.shape[2] == mask.num_rows:
        return None
    lengths = mask.causal_documents()
    if lengths is None:
        return None
    if len(lengths) == 1:
        return "fa4_causal", None, None
    if q.shape[0] != 1:
        return None

    def upload():  # pinned + non_blocking: no wait for the GPU (a pageable copy would)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).pin_memory()
        return cu.to(q.device, non_blocking=True)

    return "fa4_varlen", _DERIVED.get((mask,), ("cu_seqlens", lengths), upload), max(lengths)


def _varlen(t: torch.Tensor) -> torch.Tensor:
    """``[1, H, N, ...]`` -> FA4's varlen ``[N, H, ...]`` as a view."""
    return t.squeeze(0).transpose(0, 1)


def _launches(mask: FlashMask) -> dict:
    """The mask's recorded FA4 launches (:mod:`.launches`): they keep its block lists and bounds, and
    go with it."""
    return _DERIVED.get((mask,), "fa4_launches", dict)


def _block_sparse_key(phase: str, scale: float, q_offset: int | None, positions: torch.Tensor) -> tuple | None:
    """What a block-sparse launch's recording depends on besides its tensors; None for arbitrary rows
    (zigzag shards), whose block lists are made per call from the rows (no cheap key): FA4's own path."""
    if q_offset is None:
        return None
    return (phase, "block_sparse", scale, q_offset, positions.numel(), OPTIONS)


def cute_fwd(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, q_offset: int | None = None):
    """Forward: ``out [B, Hq, Nq, Dv]`` (q's dtype) and ``lse [B, Hq, Nq]`` float32 (natural log;
    ``-inf`` and a zero output for rows that see no key)."""
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    dense = _dense_path(mask, q, k, q_offset)
    if dense is not None:
        path, cu, longest = dense
        paths[path] += 1
        if path == "fa4_causal":
            args = (_bshd(q), _bshd(k), _bshd(v), out.transpose(1, 2), lse)

            def call(_):
                _flash_attn_fwd(*args[:3], softmax_scale=scale, causal=True, return_lse=True, out=args[3], lse=args[4])
        else:
            args = (_varlen(q), _varlen(k), _varlen(v), _varlen(out), lse.squeeze(0))

            def call(_):
                _flash_attn_fwd(*args[:3], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                softmax_scale=scale, causal=True, return_lse=True, out=args[3], lse=args[4])
        fa4_launches.launch(_launches(mask), ("fwd", path, scale, longest), args, lambda: (cu,), call)
        return out, lse
    paths["block_sparse"] += 1
    hq, d = q.shape[1], q.shape[-1]
    # Outputs allocated in our layout and handed to FA4 as [B, N, H, D] views: no copies either way.
    args = (_bshd(q), _bshd(k), _bshd(v), out.transpose(1, 2), lse)

    def prepare():  # the mask's block lists and mask_mod arguments (cached on it for consecutive rows)
        fwd_sparsity, _, fwd_order, _ = _sparsity(mask, positions, hq, d, q_offset)
        return (fwd_sparsity, *_mask_args(mask, positions, hq, q_offset, fwd_order))

    def call(made):
        sparsity, mask_mod, aux = made
        _flash_attn_fwd(*args[:3], softmax_scale=scale, mask_mod=mask_mod, aux_tensors=aux,
                        block_sparse_tensors=sparsity, return_lse=True, out=args[3], lse=args[4])

    fa4_launches.launch(_launches(mask), _block_sparse_key("fwd", scale, q_offset, positions), args, prepare, call)
    return out, lse


def cute_bwd(q, k, v, out, lse, dout, mask: FlashMask, positions, scale: float, dlse=None,
             q_offset: int | None = None, deterministic: bool = False):
    """Backward from the (possibly ring-merged) ``out`` and ``lse``: ``(dq, dk, dv)`` like the inputs.
    ``dlse``: the gradient reaching ``lse`` (the ring merge produces one).

    The pinned FA4 has no deterministic block-sparse backward on SM90 (it asserts): dQ is always added
    with atomics here. ``flashmask_attention`` refuses ``impl="cute", deterministic=True`` at its
    boundary; ``deterministic`` is accepted for the shared launcher interface."""
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dense = _dense_path(mask, q, k, q_offset)
    if dense is not None:
        path, cu, longest = dense
        if path == "fa4_causal":
            args = (_bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse.contiguous(),
                    None if dlse is None else dlse.contiguous(), dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))

            def call(_):
                _flash_attn_bwd(*args[:6], scale, causal=True, dlse=args[6], dq=args[7], dk=args[8], dv=args[9])
        else:
            args = (_varlen(q), _varlen(k), _varlen(v), _varlen(out), _varlen(dout), lse.squeeze(0).contiguous(),
                    None if dlse is None else dlse.squeeze(0).contiguous(), _varlen(dq), _varlen(dk), _varlen(dv))

            def call(_):
                _flash_attn_bwd(*args[:6], scale, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                max_seqlen_k=longest, dlse=args[6], dq=args[7], dk=args[8], dv=args[9])
        fa4_launches.launch(_launches(mask), ("bwd", path, scale, longest), args, lambda: (cu,), call)
        return dq, dk, dv
    hq, d = q.shape[1], q.shape[-1]
    args = (_bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse.contiguous(),
            None if dlse is None else dlse.contiguous(), dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2))

    def prepare():
        _, bwd_sparsity, _, bwd_order = _sparsity(mask, positions, hq, d, q_offset)
        return (bwd_sparsity, *_mask_args(mask, positions, hq, q_offset, bwd_order))

    def call(made):
        sparsity, mask_mod, aux = made
        _flash_attn_bwd(*args[:6], scale, deterministic=False, mask_mod=mask_mod, aux_tensors=aux,
                        block_sparse_tensors=sparsity, dlse=args[6], dq=args[7], dk=args[8], dv=args[9])

    fa4_launches.launch(_launches(mask), _block_sparse_key("bwd", scale, q_offset, positions), args, prepare, call)
    return dq, dk, dv


_attention = define_attention_op("flashmask_cute", cute_fwd, cute_bwd)


def attention(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, q_offset: int | None = None,
              deterministic: bool = False):
    """Differentiable FlashMask attention on FA4's kernels (``fm_parallel::flashmask_cute_fwd``);
    inputs validated by the caller, :func:`unsupported_inputs` included."""
    return _attention(q, k, v, mask, positions, scale, q_offset, deterministic)


# The launcher names of the backend interface (fm_parallel/backends.py).
forward, backward = cute_fwd, cute_bwd
