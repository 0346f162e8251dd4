"""Deprecated: the launcher interface of earlier versions, now a thin view of :mod:`fm_parallel.backends`
(the one registry and resolver). Kept so code written against it keeps working; new code calls
``backends.get(backends.resolve(impl, device, chunked=True)).forward(...)``.

    forward(q, k, v, mask, positions, scale, impl)  -> out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32
    backward(q, k, v, out, lse, dout, mask, positions, scale, impl, dlse=None) -> dq, dk, dv
"""

from __future__ import annotations

import torch

from fm_parallel import backends
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["forward", "backward", "default_impl", "resolve", "LOCAL_IMPLS"]

LOCAL_IMPLS = tuple(n for n in backends.names() if n != "auto" and backends.get(n).chunked)


def resolve(impl: str | None, device: torch.device) -> str:
    """:func:`fm_parallel.backends.resolve` for code that runs a backend per key chunk."""
    return backends.resolve(impl, device, chunked=True)


def default_impl(device: torch.device) -> str:
    """What ``auto`` means on ``device`` (the same at every entry point)."""
    return resolve("auto", device)


def forward(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, impl: str = "torch",
            q_offset: int | None = None):
    return backends.get(_known(impl)).forward(q, k, v, mask, positions, scale, q_offset)


def backward(q, k, v, out, lse, dout, mask: FlashMask, positions, scale: float, impl: str = "torch", dlse=None,
             q_offset: int | None = None):
    return backends.get(_known(impl)).backward(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset)


def _known(impl: str) -> str:
    if impl not in LOCAL_IMPLS:
        raise ValueError(f"impl: expected one of {LOCAL_IMPLS} (resolve 'auto' first), got {impl!r}")
    return impl
