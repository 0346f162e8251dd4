"""Per-token work over tiles of the sequence, recomputed tile by tile in the backward: what is kept
for the backward is the input, not the work's intermediates, and each tile's input gradient is
written into one buffer (slicing under autograd would build a full-length zero gradient per tile:
O(N^2 / tile) memory traffic, and one more full-length tensor at the peak).

    y = tiled_map(norm, x, 16384, params=norm.parameters())       # [B, N, ...] -> [B, N, ...]
    loss = tiled_sum(lambda h, y: ce(head(h), y), hidden, 8192, labels, params=head.parameters())

Also the helpers the tiled decoder layer (:mod:`.tiling`) shares with them.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

__all__ = ["tiled_map", "tiled_sum", "per_tile", "tile_ranges", "trainable_parameters", "AutocastState", "TileGrads",
           "detached_leaf"]


def tile_ranges(r0: int, r1: int, tile: int):
    """``(a, b)`` of each tile of at most ``tile`` rows in ``[r0, r1)``."""
    for a in range(r0, r1, tile):
        yield a, min(a + tile, r1)


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` that get gradients (a tile function's autograd inputs)."""
    return [p for p in module.parameters() if p.requires_grad]


class AutocastState:
    """The autocast state of the forward, re-entered for the backward's recomputation (as
    ``torch.utils.checkpoint`` does): the recomputed tiles must round like the forward's."""

    def __init__(self, device: torch.device):
        self.kind = device.type
        try:
            self.enabled = torch.is_autocast_enabled(self.kind)
            self.dtype = torch.get_autocast_dtype(self.kind)
        except (RuntimeError, TypeError):  # a device type autocast does not know
            self.enabled, self.dtype = False, None

    def __call__(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.kind, dtype=self.dtype)


class TileGrads:
    """Gradients of a tile's recomputed outputs, accumulated for the inputs of the whole sequence:
    the tile's input gradient is written (or added) into a full buffer, the parameters' summed."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params, self.sums = params, [None] * len(params)

    def __call__(self, outputs, grad_outputs, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``torch.autograd.grad`` of ``outputs`` for the ``leaves`` (tiles made with
        ``detach().requires_grad_()``) and the parameters; returns the leaves' gradients."""
        wanted = [t for t in leaves if t.requires_grad]
        if isinstance(outputs, torch.Tensor):
            outputs, grad_outputs = (outputs,), (grad_outputs,)
        # An output no input or parameter reaches (the first layer's keys when k_proj has no adapter and
        # the embeddings are frozen) has no gradient to give: left out, as autograd refuses it.
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        if not pairs or (not wanted and not self.params):
            return [None] * len(leaves)
        got = torch.autograd.grad([o for o, _ in pairs], [*wanted, *self.params], [g for _, g in pairs], allow_unused=True)
        for i, g in enumerate(got[len(wanted):]):
            if g is not None:
                self.sums[i] = g if self.sums[i] is None else self.sums[i].add_(g)
        it = iter(got[: len(wanted)])
        return [next(it) if t.requires_grad else None for t in leaves]


def detached_leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


def _recompute_tiles(ctx, grad_of_tile):
    """The backward of :class:`_TiledMap` / :class:`_TiledSum`: each tile of the saved ``x`` recomputed
    with autograd and differentiated with ``grad_of_tile(a, b)``; its input gradient is written into one
    buffer, the parameters' summed. Returns the Functions' input gradients."""
    (x,) = ctx.saved_tensors
    grads = TileGrads(ctx.params)
    dx = torch.empty_like(x) if ctx.needs_input_grad[4] else None
    for a, b in tile_ranges(0, x.shape[1], ctx.tile):
        x_l = detached_leaf(x[:, a:b], dx is not None)
        with torch.enable_grad(), ctx.autocast():
            out = ctx.fn(x_l, *(e[:, a:b] for e in ctx.extra))
        (gx,) = grads(out, grad_of_tile(a, b), [x_l])
        if dx is not None:
            dx[:, a:b] = gx
    return (None, None, None, None, dx, *grads.sums)


class _TiledMap(torch.autograd.Function):
    """``fn`` applied tile by tile along dim 1 of ``x`` (and of ``extra``, which gets no gradient);
    ``params``: the trainable parameters ``fn`` uses, passed again as inputs so autograd asks for
    their gradients."""

    @staticmethod
    def forward(ctx, fn, tile, extra, params, x, *param_tensors):
        ctx.fn, ctx.tile, ctx.extra, ctx.params, ctx.autocast = fn, tile, extra, params, AutocastState(x.device)
        ctx.save_for_backward(x)
        n, out = x.shape[1], None
        for a, b in tile_ranges(0, n, tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            if out is None:
                out = part.new_empty(part.shape[0], n, *part.shape[2:])
            out[:, a:b] = part
        return out

    @staticmethod
    def backward(ctx, dout):
        return _recompute_tiles(ctx, lambda a, b: dout[:, a:b])


def tiled_map(fn: Callable, x: torch.Tensor, tile: int, *extra: torch.Tensor, params=()) -> torch.Tensor:
    """``fn(x)`` for a per-token ``fn`` (``[B, t, ...] -> [B, t, ...]``), run over tiles of ``tile``
    tokens and recomputed tile by tile in the backward: what is kept is ``x``, not ``fn``'s
    intermediates. ``extra``: more per-token inputs sliced alike (no gradient). ``params``: the
    trainable parameters ``fn`` uses (their gradients are returned through autograd)."""
    params = [p for p in params if p.requires_grad]
    if x.shape[1] <= tile:
        return fn(x, *extra)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):  # no backward: tiles, nothing kept
        return per_tile(lambda a, b: fn(x[:, a:b], *(e[:, a:b] for e in extra)), 0, x.shape[1], tile)
    return _TiledMap.apply(fn, tile, extra, params, x, *params)


class _TiledSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, extra, params, x, *param_tensors):
        ctx.fn, ctx.tile, ctx.extra, ctx.params, ctx.autocast = fn, tile, extra, params, AutocastState(x.device)
        ctx.save_for_backward(x)
        total = None
        for a, b in tile_ranges(0, x.shape[1], tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, dtotal):
        return _recompute_tiles(ctx, lambda a, b: dtotal)


def tiled_sum(fn: Callable, x: torch.Tensor, tile: int, *extra: torch.Tensor, params=()) -> torch.Tensor:
    """``sum over tiles of fn(x_tile, *extra_tiles)`` (a scalar per tile, e.g. a summed loss), each
    tile recomputed in the backward: ``fn``'s intermediates (full-vocabulary logits) exist for one
    tile at a time, and ``x``'s gradient is written tile by tile into one buffer."""
    params = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        total = None
        for a, b in tile_ranges(0, x.shape[1], tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            total = part if total is None else total + part
        return total
    return _TiledSum.apply(fn, tile, extra, params, x, *params)


def per_tile(fn, r0: int, r1: int, tile: int):
    """``fn(a, b)`` over the tiles of rows ``[r0, r1)``, each output (a tensor or a tuple of them,
    ``[B, t, ...]``) written into one ``[B, r1 - r0, ...]`` buffer: no concatenation copy."""
    out = None
    for a, b in tile_ranges(r0, r1, tile):
        part = fn(a, b)
        single = isinstance(part, torch.Tensor)
        parts = (part,) if single else part
        if out is None:
            out = [p.new_empty(p.shape[0], r1 - r0, *p.shape[2:]) for p in parts]
        for buf, p in zip(out, parts):
            buf[:, a - r0 : b - r0] = p
    return out[0] if single else tuple(out)
