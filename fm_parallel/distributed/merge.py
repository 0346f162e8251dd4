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
        ``(out, lse)`` over the union of the keys, in the dtypes of ``out`` and ``lse`` (weighed in
        ``lse``'s precision, rounded once: :func:`merge_into`). Rows that neither part saw stay
        0 / -inf (no NaN).
    """
    merged, new = torch.empty_like(out), torch.empty_like(lse)
    merge_into(merged, new, out, lse, block_out, block_lse)
    return merged, new


def merge_into(dst: torch.Tensor, lse_dst: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
               lse_b: torch.Tensor) -> None:
    """:func:`merge` written into ``dst`` / ``lse_dst`` (views allowed; ``dst`` may be ``a``, ``lse_dst``
    ``lse_a``). The parts are weighed in float32 (float64) whatever their dtype and rounded once into
    ``dst``'s: four passes over ``[B, H, R, Dv]`` instead of :func:`merge`'s eight and its conversions."""
    lse_b = lse_b.to(lse_a.dtype)
    new = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    dst.copy_(torch.addcmul(a * w_a, b, w_b))  # computed in the weights' precision, then rounded once
    lse_dst.copy_(new)
