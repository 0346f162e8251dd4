"""A backend's forward and backward launchers as ``torch.library`` custom ops with autograd.

Custom ops let a ``torch.compile``d model call our kernels without graph breaks (eager calls take
an ``autograd.Function`` around the same launchers: the dispatcher costs host time). They take plain
tensors, so the mask enters as its bounds: a new mask is new data, never a new graph or a
recompilation. Each backend then needs the :class:`FlashMask` object back, with its cache of launch
metadata: :func:`known_mask` finds the live FlashMask whose bounds these tensors are (the objects or
aliases of them: :meth:`FlashMask.owning`, a weak index trusted only while the owner lives and still
holds that memory, so nothing is stale and nothing is kept alive), else makes one. Its caches are
keyed on the bounds' version counters, so an in-place edit is a miss. Eager calls pass the mask
object itself. Shared by the Triton and CuTe backends.

    forward(q, k, v, mask, positions, scale, q_offset) -> out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32
    backward(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset, deterministic) -> dq, dk, dv

``q_offset`` is None when the rows are arbitrary ``positions`` (ops carry it as -1).
"""

from __future__ import annotations

from typing import Callable

import torch

from fm_parallel.masks.flashmask import FlashMask

__all__ = ["define_attention_op", "known_mask"]


def known_mask(fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> FlashMask:
    """The live FlashMask these bounds belong to, with its caches (launch plans, block lists,
    what it knows of its document structure), or a new one."""
    mask = FlashMask.owning(fms, fme, num_rows)
    return mask if mask is not None else FlashMask(fms, fme, num_rows, validate=False)


def _grad_out(dout: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The output's gradient for the backward launchers: zeros when only the lse was used."""
    return torch.zeros_like(out) if dout is None else dout.contiguous()


def _offset(q_offset: int) -> int | None:
    return None if q_offset < 0 else q_offset


def define_attention_op(name: str, forward: Callable, backward: Callable) -> Callable:
    """Register ``fm_parallel::{name}_fwd`` / ``_bwd`` and return the differentiable
    ``attention(q, k, v, mask, positions, scale, q_offset=None, deterministic=True) -> (out, lse)``."""

    def run_forward(q, k, v, mask, positions, scale, q_offset):
        return forward(q, k, v, mask, positions, scale, _offset(q_offset))

    def run_backward(q, k, v, out, lse, dout, dlse, mask, positions, scale, q_offset, deterministic):
        return backward(q, k, v, out, lse, dout, mask, positions, scale, dlse, _offset(q_offset), deterministic)

    @torch.library.custom_op(f"fm_parallel::{name}_fwd", mutates_args=())
    def fwd_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fms: torch.Tensor, fme: torch.Tensor,
        positions: torch.Tensor, num_rows: int, scale: float, q_offset: int, deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_forward(q, k, v, known_mask(fms, fme, num_rows), positions, scale, q_offset)

    @fwd_op.register_fake
    def _(q, k, v, fms, fme, positions, num_rows, scale, q_offset, deterministic):
        return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.custom_op(f"fm_parallel::{name}_bwd", mutates_args=())
    def bwd_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
        dlse: torch.Tensor | None, fms: torch.Tensor, fme: torch.Tensor, positions: torch.Tensor,
        num_rows: int, scale: float, q_offset: int, deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = known_mask(fms, fme, num_rows)
        return run_backward(q, k, v, out, lse, dout, dlse, mask, positions, scale, q_offset, deterministic)

    @bwd_op.register_fake
    def _(q, k, v, out, lse, dout, dlse, fms, fme, positions, num_rows, scale, q_offset, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, fms, fme, positions, num_rows, scale, q_offset, deterministic = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, fms, fme, positions)
        ctx.num_rows, ctx.scale, ctx.q_offset, ctx.deterministic = num_rows, scale, q_offset, deterministic

    def grads(ctx, dout, dlse):
        q, k, v, out, lse, fms, fme, positions = ctx.saved_tensors
        dq, dk, dv = bwd_op(q, k, v, out, lse, _grad_out(dout, out), dlse, fms, fme, positions, ctx.num_rows, ctx.scale,
                            ctx.q_offset, ctx.deterministic)
        return dq, dk, dv, *(None,) * 7

    fwd_op.register_autograd(grads, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        """The same launchers without the dispatcher, outside ``torch.compile``, on the caller's mask
        object: the custom op's dispatch and autograd wrapping cost 0.15-0.2 ms of host time per
        forward on the H200's host (launch/bench/host_overhead.py at b8693dc), as long as a whole
        packed-document forward on the GPU."""

        @staticmethod
        def forward(ctx, q, k, v, mask, positions, scale, q_offset, deterministic):
            out, lse = run_forward(q, k, v, mask, positions, scale, q_offset)
            ctx.save_for_backward(q, k, v, out, lse, positions)
            ctx.mask, ctx.scale, ctx.q_offset, ctx.deterministic = mask, scale, q_offset, deterministic
            ctx.set_materialize_grads(False)  # an unused lse gets no gradient tensor (like the op)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, positions = ctx.saved_tensors
            dq, dk, dv = run_backward(q, k, v, out, lse, _grad_out(dout, out), dlse, ctx.mask, positions, ctx.scale,
                                      ctx.q_offset, ctx.deterministic)
            return dq, dk, dv, *(None,) * 5

    def attention(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, q_offset: int | None = None,
                  deterministic: bool = True):
        offset = -1 if q_offset is None else q_offset
        if torch.compiler.is_compiling():
            # Tensors only: the op finds the mask object again from its bounds (known_mask), with what it
            # knows of its structure and its launch plans.
            return fwd_op(q, k, v, mask.fms, mask.fme, positions, mask.num_rows, float(scale), offset, bool(deterministic))
        return Eager.apply(q, k, v, mask, positions, float(scale), offset, bool(deterministic))

    attention.__doc__ = (f"Differentiable FlashMask attention through ``fm_parallel::{name}_fwd`` under torch.compile, "
                         "the same launchers directly otherwise (inputs validated by the caller).")
    return attention
