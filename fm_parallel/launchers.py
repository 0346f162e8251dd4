"""One launcher interface over the local implementations, for code that defines its own backward.

The distributed wrappers (ring, Ulysses) call ``forward`` per received chunk and ``backward`` with
the *merged* output and log-sum-exp, exactly like flash-attention's ring implementations; they
never go through autograd of the local op. Inputs are assumed validated.

    forward(q, k, v, mask, positions, scale, impl)  -> out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32
    backward(q, k, v, out, lse, dout, mask, positions, scale, impl, dlse=None) -> dq, dk, dv
"""

from __future__ import annotations

import os

import torch

from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.reference import DEFAULT_BLOCK, _blockwise_backward, _blockwise_forward, _plan

__all__ = ["forward", "backward", "default_impl", "resolve", "LOCAL_IMPLS"]

LOCAL_IMPLS = ("torch", "triton", "cute")


def default_impl(device: torch.device) -> str:
    """Triton on CUDA (and under the Triton interpreter when FM_LOCAL_IMPL=triton), else PyTorch."""
    forced = os.environ.get("FM_LOCAL_IMPL")
    if forced and forced != "auto":
        return _checked(forced, device)
    return "triton" if device.type == "cuda" else "torch"


def resolve(impl: str | None, device: torch.device) -> str:
    """The local kernel a distributed wrapper runs: ``None`` / ``"auto"`` -> :func:`default_impl`; a
    known name is kept; anything else raises (it once ran the PyTorch path silently, on a GPU too)."""
    if impl is None or impl == "auto":
        return default_impl(device)
    return _checked(impl, device)


def _checked(impl: str, device: torch.device) -> str:
    from fm_parallel.attention import _runs_here  # the same device rule as flashmask_attention's

    if impl not in LOCAL_IMPLS:
        raise ValueError(f"impl: expected one of {('auto',) + LOCAL_IMPLS} or None, got {impl!r}")
    if impl != "torch" and not _runs_here(impl, device):
        raise ValueError(f"impl: {impl!r} needs CUDA tensors, got device {device}")
    return impl


def _known(impl: str) -> None:
    if impl not in LOCAL_IMPLS:
        raise ValueError(f"impl: expected one of {LOCAL_IMPLS} (resolve 'auto' first), got {impl!r}")


def forward(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, impl: str = "torch",
            q_offset: int | None = None):
    """``q_offset``: when ``positions`` is ``q_offset + arange(Nq)`` (a contiguous shard), the GPU
    backends build their launch plans for consecutive rows and cache them on ``mask``."""
    _known(impl)
    if impl == "cute":
        from fm_parallel.kernels.cute_flashmask import cute_fwd

        return cute_fwd(q, k, v, mask, positions, scale, q_offset)
    if impl == "triton":
        from fm_parallel.kernels.triton_flashmask import flashmask_fwd

        return flashmask_fwd(q, k, v, mask, positions, scale, q_offset)
    plans = _plan(mask, positions, DEFAULT_BLOCK, DEFAULT_BLOCK)
    out, lse = _blockwise_forward(q, k, v, mask, positions, scale, plans)
    return out, lse  # float32 (float64 for float64 inputs)


def backward(q, k, v, out, lse, dout, mask: FlashMask, positions, scale: float, impl: str = "torch", dlse=None,
             q_offset: int | None = None):
    _known(impl)
    if impl == "cute":
        from fm_parallel.kernels.cute_flashmask import cute_bwd

        return cute_bwd(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset=q_offset)
    if impl == "triton":
        from fm_parallel.kernels.triton_flashmask import flashmask_bwd

        return flashmask_bwd(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset=q_offset)
    plans = _plan(mask, positions, DEFAULT_BLOCK, DEFAULT_BLOCK)
    return _blockwise_backward(q, k, v, out, lse, dout, dlse, mask, positions, scale, plans)
