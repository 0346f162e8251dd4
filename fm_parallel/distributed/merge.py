"""The one log-sum-exp merge of partial attention results, used by every schedule."""

from __future__ import annotations

import torch

__all__ = ["merge", "merge_into"]


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Combine two softmax-normalised partial results over disjoint key sets.

    Args:
        out, block_out: ``[B, H, N, Dv]`` partial outputs (each normalised over its own keys).
        lse, block_lse: ``[B, H, N]`` their natural log-sum-exps; ``-inf`` where a part saw no key.
    Returns:
        ``(out, lse)`` over the union of the keys, in the dtypes of ``out`` and ``lse``. Rows that
        neither part saw stay 0 / -inf (no NaN).
    """
    new = torch.logaddexp(lse, block_lse.to(lse.dtype))
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(block_lse.to(lse.dtype) - safe).unsqueeze(-1)
    merged = out * w_old.to(out.dtype) + block_out.to(out.dtype) * w_new.to(out.dtype)
    return merged, new


def merge_into(dst: torch.Tensor, lse_dst: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
               lse_b: torch.Tensor) -> None:
    """:func:`merge` written into ``dst`` / ``lse_dst`` (views allowed, ``dst`` may be ``a``): on CUDA one
    Triton pass (``fm_parallel.kernels.triton_merge``), elsewhere the PyTorch ops above."""
    if dst.is_cuda:
        from fm_parallel.kernels.triton_merge import merge_into as fused

        fused(dst, lse_dst, a, lse_a, b, lse_b)
        return
    out, lse = merge(a.to(dst.dtype), lse_a.to(lse_dst.dtype), b, lse_b)
    dst.copy_(out)
    lse_dst.copy_(lse)
