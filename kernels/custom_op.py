"""A backend's forward and backward launchers as ``torch.library`` custom ops with autograd.

Custom ops let a ``torch.compile``d model call our kernels without graph breaks (eager calls take
an ``autograd.Function`` around the same launchers: the dispatcher costs host time). They take plain
tensors, so the mask enters as its bounds: a new mask is new data, never a new graph or a
recompilation. Each backend then needs the :class:`FlashMask` object back, with its cache of launch
metadata; a small registry keeps the last few per storage. It holds the tensors (so their memory
cannot be reused under the same key) and keys on their version counters (so an in-place edit of the
bounds is a miss). Shared by the Triton and CuTe backends.

    forward(q, k, v, mask, positions, scale, q_offset) -> out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32
    backward(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset, deterministic) -> dq, dk, dv

``q_offset`` is None when the rows are arbitrary ``positions`` (ops carry it as -1).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Callable

import torch

from fm_parallel.masks.flashmask import FlashMask

__all__ = ["define_attention_op", "registered_mask"]

_REGISTRY: OrderedDict = OrderedDict()
_REGISTRY_SIZE = 16


def registered_mask(fms: torch.Tensor, fme: torch.Tensor, num_rows: int) -> FlashMask:
    key = (fms.data_ptr(), fms._version, fme.data_ptr(), fme._version, tuple(fms.shape), num_rows, str(fms.device))
    entry = _REGISTRY.get(key)
    if entry is None:
        entry = (fms, fme, FlashMask(fms, fme, num_rows, validate=False))
        _REGISTRY[key] = entry
        if len(_REGISTRY) > _REGISTRY_SIZE:
            _REGISTRY.popitem(last=False)
    else:
        _REGISTRY.move_to_end(key)
    return entry[2]


def _known(fms, fme, num_rows: int, documents: tuple[int, ...] | None) -> FlashMask:
    """The registered mask, told what the caller's mask knew of its structure (same bounds, same versions)."""
    mask = registered_mask(fms, fme, num_rows)
    if documents is not None:
        mask.set_causal_documents(documents)
    return mask


def _offset(q_offset: int) -> int | None:
    return None if q_offset < 0 else q_offset


def define_attention_op(name: str, forward: Callable, backward: Callable) -> Callable:
    """Register ``fm_parallel::{name}_fwd`` / ``_bwd`` and return the differentiable
    ``attention(q, k, v, mask, positions, scale, q_offset=None, deterministic=True) -> (out, lse)``."""

    def run_forward(q, k, v, fms, fme, positions, num_rows, scale, q_offset, documents=None):
        return forward(q, k, v, _known(fms, fme, num_rows, documents), positions, scale, _offset(q_offset))

    def run_backward(q, k, v, out, lse, dout, dlse, fms, fme, positions, num_rows, scale, q_offset, deterministic,
                     documents=None):
        mask = _known(fms, fme, num_rows, documents)
        return backward(q, k, v, out, lse, dout, mask, positions, scale, dlse, _offset(q_offset), deterministic)

    @torch.library.custom_op(f"fm_parallel::{name}_fwd", mutates_args=())
    def fwd_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fms: torch.Tensor, fme: torch.Tensor,
        positions: torch.Tensor, num_rows: int, scale: float, q_offset: int, deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return run_forward(q, k, v, fms, fme, positions, num_rows, scale, q_offset)

    @fwd_op.register_fake
    def _(q, k, v, fms, fme, positions, num_rows, scale, q_offset, deterministic):
        return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.custom_op(f"fm_parallel::{name}_bwd", mutates_args=())
    def bwd_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
        dlse: torch.Tensor | None, fms: torch.Tensor, fme: torch.Tensor, positions: torch.Tensor,
        num_rows: int, scale: float, q_offset: int, deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_backward(q, k, v, out, lse, dout, dlse, fms, fme, positions, num_rows, scale, q_offset, deterministic)

    @bwd_op.register_fake
    def _(q, k, v, out, lse, dout, dlse, fms, fme, positions, num_rows, scale, q_offset, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, fms, fme, positions, num_rows, scale, q_offset, deterministic = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, fms, fme, positions)
        ctx.num_rows, ctx.scale, ctx.q_offset, ctx.deterministic = num_rows, scale, q_offset, deterministic

    def gradients(ctx, dout, dlse, run) -> tuple:
        """(dq, dk, dv) from what ``setup_context`` saved, through ``run`` (the op, or its body)."""
        q, k, v, out, lse, fms, fme, positions = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        return run(q, k, v, out, lse, dout.contiguous(), dlse, fms, fme, positions, ctx.num_rows, ctx.scale,
                   ctx.q_offset, ctx.deterministic)

    def grads(ctx, dout, dlse):
        return (*gradients(ctx, dout, dlse, bwd_op), *(None,) * 7)

    fwd_op.register_autograd(grads, setup_context=setup_context)

    class Eager(torch.autograd.Function):
        """The same launchers without the dispatcher, outside ``torch.compile``: the custom op's
        dispatch and autograd wrapping cost 0.15-0.2 ms of host time per forward on the H200's host
        (launch/bench/host_overhead.py), as long as a whole packed-document forward on the GPU."""

        @staticmethod
        def forward(ctx, *inputs):
            *op_inputs, documents = inputs
            output = run_forward(*op_inputs[:-1], documents)  # every op input but ``deterministic``
            setup_context(ctx, op_inputs, output)
            ctx.documents = documents
            ctx.set_materialize_grads(False)  # an unused lse gets no gradient tensor (like the op)
            return output

        @staticmethod
        def backward(ctx, dout, dlse):
            run = functools.partial(run_backward, documents=ctx.documents)
            return (*gradients(ctx, dout, dlse, run), *(None,) * 8)

    def attention(q, k, v, mask: FlashMask, positions: torch.Tensor, scale: float, q_offset: int | None = None,
                  deterministic: bool = True):
        args = (q, k, v, mask.fms, mask.fme, positions, mask.num_rows, float(scale),
                -1 if q_offset is None else q_offset, bool(deterministic))
        if torch.compiler.is_compiling():
            return fwd_op(*args)
        # Eager calls also carry what the mask knows of its structure (the op takes tensors only).
        return Eager.apply(*args, mask.causal_documents())

    attention.__doc__ = (f"Differentiable FlashMask attention through ``fm_parallel::{name}_fwd`` under torch.compile, "
                         "the same launchers directly otherwise (inputs validated by the caller).")
    return attention
