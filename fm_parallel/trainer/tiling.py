"""Sequence tiling: at long context a decoder layer keeps only its input for the backward, and its
backward holds a few ``N x hidden`` tensors, not dozens.

A Llama-family decoder layer is per-token everywhere but inside attention::

    q         = rope(q_norm(q_proj(norm1(x))))                  per token   (the "query part")
    k, v      = rope(k_norm(k_proj(norm1(x)))), v_proj(norm1(x)) per token   (the "key part")
    o         = attention(q, k, v, mask)
    y         = h + mlp(norm2(h)),  h = x + o_proj(o)            per token   (the "output part")

:class:`TiledLayer` (an autograd Function, its own activation checkpoint) runs the per-token parts
over tiles of ``tile`` tokens and keeps only ``x``. Its backward recomputes what it needs tile by tile
and writes each tile's input gradient into one ``N x hidden`` buffer (no ``torch.cat``, no
full-length zero tensor per tile as slicing under autograd makes: that cost O(N^2 / tile) time).

With FlashMask attention and no context parallelism the attention itself runs per *query chunk*
(:func:`attention_chunks`: chunks of at most ``attention_chunk`` rows cut where no visibility
crosses, e.g. between packed documents, each with the window of keys its rows see). Then the full
q, the attention output and its gradient never exist: the backward holds x, its gradient, dy, k, v
and their gradients, plus one chunk's q / o / do / dq and the kernel's workspace for it. A chunk cut
between documents is an independent problem (local rows: FA4 runs its varlen kernel on it), and its
keys' gradients come from it alone; chunks whose key windows overlap add theirs in float32. Under
context parallelism, or with the SDPA / Flex baselines, the attention runs over the whole sequence
(:class:`_WholeAttention`: the layer's own attention function, differentiated by autograd).

Measured (docs/long-context.md): an 8B-shaped Llama's memory beyond the checkpoints at the step's peak
on the H200 went from 213 (untiled) to 105 (tiled per-token parts, whole-sequence attention) to the
figure given there with chunked attention. Exact: float64 losses and LoRA gradients equal to the
untiled layer's (tests/trainer/test_tiling.py).

Also here: :func:`tiled_map` (a per-token function over tiles, e.g. the final norm) and
:func:`tiled_sum` (a loss summed over token chunks: full-vocabulary logits never exist at once).
"""

from __future__ import annotations

import bisect
import contextlib
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from fm_parallel import backends
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.trainer.memory import decoder_layers

__all__ = ["tile_decoder_layers", "tiled_map", "tiled_sum", "attention_chunks", "AttentionChunk", "TiledLayer"]

_NEEDED = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_NEEDED = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


# ---------------------------------------------------------------------------------------- helpers
def _tiles(r0: int, r1: int, tile: int):
    for a in range(r0, r1, tile):
        yield a, min(a + tile, r1)


def _trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class _Autocast:
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


class _Grads:
    """Gradients of a tile's recomputed outputs, accumulated for the inputs of the whole sequence:
    the tile's input gradient is written (or added) into a full buffer, the parameters' summed."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params, self.sums = params, [None] * len(params)

    def __call__(self, outputs, grad_outputs, leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """``torch.autograd.grad`` of ``outputs`` for the ``leaves`` (tiles made with
        ``detach().requires_grad_()``) and the parameters; returns the leaves' gradients."""
        wanted = [t for t in leaves if t.requires_grad]
        if not wanted and not self.params:
            return [None] * len(leaves)
        got = torch.autograd.grad(outputs, [*wanted, *self.params], grad_outputs, allow_unused=True)
        for i, g in enumerate(got[len(wanted):]):
            if g is not None:
                self.sums[i] = g if self.sums[i] is None else self.sums[i].add_(g)
        it = iter(got[: len(wanted)])
        return [next(it) if t.requires_grad else None for t in leaves]


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


# ------------------------------------------------------------------------------- per-token maps
class _TiledMap(torch.autograd.Function):
    """``fn`` applied tile by tile along dim 1 of ``x`` (and of ``extra``, which gets no gradient);
    ``params``: the trainable parameters ``fn`` uses, passed again as inputs so autograd asks for
    their gradients."""

    @staticmethod
    def forward(ctx, fn, tile, extra, params, x, *param_tensors):
        ctx.fn, ctx.tile, ctx.extra, ctx.params, ctx.autocast = fn, tile, extra, params, _Autocast(x.device)
        ctx.save_for_backward(x)
        n, out = x.shape[1], None
        for a, b in _tiles(0, n, tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            if out is None:
                out = part.new_empty(part.shape[0], n, *part.shape[2:])
            out[:, a:b] = part
        return out

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        grads = _Grads(ctx.params)
        dx = torch.empty_like(x) if ctx.needs_input_grad[4] else None
        for a, b in _tiles(0, x.shape[1], ctx.tile):
            x_l = _leaf(x[:, a:b], dx is not None)
            with torch.enable_grad(), ctx.autocast():
                out = ctx.fn(x_l, *(e[:, a:b] for e in ctx.extra))
            (gx,) = grads(out, dout[:, a:b], [x_l])
            if dx is not None:
                dx[:, a:b] = gx
        return (None, None, None, None, dx, *grads.sums)


def tiled_map(fn: Callable, x: torch.Tensor, tile: int, *extra: torch.Tensor, params=()) -> torch.Tensor:
    """``fn(x)`` for a per-token ``fn`` (``[B, t, ...] -> [B, t, ...]``), run over tiles of ``tile``
    tokens and recomputed tile by tile in the backward: what is kept is ``x``, not ``fn``'s
    intermediates. ``extra``: more per-token inputs sliced alike (no gradient). ``params``: the
    trainable parameters ``fn`` uses (their gradients are returned through autograd)."""
    params = [p for p in params if p.requires_grad]
    if x.shape[1] <= tile:
        return fn(x, *extra)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):  # no backward: tiles, nothing kept
        return _per_tile(lambda a, b: fn(x[:, a:b], *(e[:, a:b] for e in extra)), 0, x.shape[1], tile)
    return _TiledMap.apply(fn, tile, extra, params, x, *params)


class _TiledSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile, extra, params, x, *param_tensors):
        ctx.fn, ctx.tile, ctx.extra, ctx.params, ctx.autocast = fn, tile, extra, params, _Autocast(x.device)
        ctx.save_for_backward(x)
        total = None
        for a, b in _tiles(0, x.shape[1], tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx, dtotal):
        (x,) = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[4]
        grads = _Grads(ctx.params)
        dx = torch.empty_like(x) if needs_x else None
        for a, b in _tiles(0, x.shape[1], ctx.tile):
            x_l = _leaf(x[:, a:b], needs_x)
            with torch.enable_grad(), ctx.autocast():
                part = ctx.fn(x_l, *(e[:, a:b] for e in ctx.extra))
            (gx,) = grads(part, dtotal, [x_l])
            if dx is not None:
                dx[:, a:b] = gx
        return (None, None, None, None, dx, *grads.sums)


def tiled_sum(fn: Callable, x: torch.Tensor, tile: int, *extra: torch.Tensor, params=()) -> torch.Tensor:
    """``sum over tiles of fn(x_tile, *extra_tiles)`` (a scalar per tile, e.g. a summed loss), each
    tile recomputed in the backward: ``fn``'s intermediates (full-vocabulary logits) exist for one
    tile at a time, and ``x``'s gradient is written tile by tile into one buffer."""
    params = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        total = None
        for a, b in _tiles(0, x.shape[1], tile):
            part = fn(x[:, a:b], *(e[:, a:b] for e in extra))
            total = part if total is None else total + part
        return total
    return _TiledSum.apply(fn, tile, extra, params, x, *params)


# --------------------------------------------------------------------------- attention chunks
@dataclass(frozen=True)
class AttentionChunk:
    """Query rows ``[r0, r1)`` and the key window ``[k0, k1)`` they see (``k0 == k1``: none).
    ``mask``: the window's mask; ``local``: rows and keys renumbered from ``r0`` (the chunk is an
    independent problem: its rows see only its keys and no other row sees them), else the parent's
    global rows with ``q_offset = r0``. ``positions``: the rows as the kernel reads them."""

    r0: int
    r1: int
    k0: int
    k1: int
    mask: FlashMask | None
    local: bool
    positions: torch.Tensor | None

    @property
    def q_offset(self) -> int:
        return 0 if self.local else self.r0


def attention_chunks(mask: FlashMask, rows: int) -> tuple[tuple[AttentionChunk, ...], bool]:
    """The query chunks of at most ``rows`` rows that :class:`TiledLayer` runs attention over, and
    whether their key windows overlap (keys' gradients then add up over chunks, in float32).

    Chunks end at *cuts* where possible: a row ``b`` such that no row ``>= b`` sees a key ``< b``
    and no row ``< b`` sees a key ``>= b`` (between packed documents, between DPO samples). A chunk
    between two cuts is local (an independent attention problem; causal documents stay known, so FA4
    runs its varlen kernel on it). Where no cut lies within ``rows`` (one long document), the chunk
    ends at ``rows`` and sees the window of keys its rows see.

    Cached on the mask (``("attention_chunks", rows)``, one device sync to make): every layer of a
    step uses the same chunks, and each chunk's mask keeps its kernels' plans for the step."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows: expected a positive number of query rows per chunk, got {rows!r}")
    return mask.cached(("attention_chunks", rows), lambda: _make_chunks(mask, rows))


def _make_chunks(mask: FlashMask, rows: int) -> tuple[tuple[AttentionChunk, ...], bool]:
    n = mask.num_keys
    if mask.num_rows != n or n <= rows:
        positions = torch.arange(mask.num_rows, dtype=torch.int32, device=mask.device)
        return (AttentionChunk(0, mask.num_rows, 0, n, mask, False, positions),), False
    first_row = mask.fms.amin(dim=(0, 1, 3)).long()  # [N]: the first row that sees key j (num_rows: none)
    last_row = mask.fme.amax(dim=(0, 1, 3)).long()  # [N]: the last (-1: none)
    b = torch.arange(1, n, device=mask.device)
    seen_later = torch.cummax(last_row, 0).values[:-1] >= b  # a key < b seen by a row >= b
    seen_earlier = torch.flip(torch.cummin(torch.flip(first_row, (0,)), 0).values, (0,))[1:] < b  # a key >= b by a row < b
    cuts = b[~(seen_later | seen_earlier)].tolist() + [n]
    bounds, r0 = [], 0
    while r0 < n:
        i = bisect.bisect_right(cuts, r0 + rows) - 1
        r1 = cuts[i] if i >= 0 and cuts[i] > r0 else min(r0 + rows, n)
        bounds.append((r0, r1))
        r0 = r1
    cut_set = set(cuts) | {0}
    windows = []
    for r0, r1 in bounds:  # the hull of the keys some row of [r0, r1) may see
        sees = (first_row <= r1 - 1) & (last_row >= r0)
        idx = torch.arange(n, device=mask.device)
        windows.append(torch.stack([torch.where(sees, idx, n).min(), torch.where(sees, idx, -1).max() + 1]))
    windows = torch.stack(windows).tolist()  # one sync for all chunks
    documents = mask.causal_documents()
    doc_ends = None if documents is None else [0, *_cumsum(documents)]
    plain = None if documents is not None else _causal_document_keys(mask)  # padded rows: per chunk
    chunks = []
    for (r0, r1), (k0, k1) in zip(bounds, windows):
        if k1 <= k0:
            chunks.append(AttentionChunk(r0, r1, 0, 0, None, False, None))
            continue
        if r0 in cut_set and r1 in cut_set and r0 <= k0 and k1 <= r1:
            ends = doc_ends
            if plain is not None and all(plain[0][r0:r1]):  # this chunk is causal documents (the row's padding is not)
                ends = [r0, *(j + 1 for j in range(r0, r1) if plain[1][j])]
            sub = _local_mask(mask, r0, r1, ends)
            chunks.append(AttentionChunk(r0, r1, r0, r1, sub, True,
                                         torch.arange(r1 - r0, dtype=torch.int32, device=mask.device)))
        else:
            chunks.append(AttentionChunk(r0, r1, k0, k1, mask.select_keys(slice(k0, k1)), False,
                                         torch.arange(r0, r1, dtype=torch.int32, device=mask.device)))
    spans = sorted((c.k0, c.k1) for c in chunks if c.k1 > c.k0)
    overlap = any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    return tuple(chunks), overlap


def _causal_document_keys(mask: FlashMask):
    """``(causal, ends)`` host lists over the keys (one sync), or None: ``causal[j]`` when key ``j`` is
    seen exactly by rows ``j .. e`` with ``e`` the next document end, ``ends[j]`` when ``j`` ends a
    document (its last row is itself). A chunk of causal keys between cuts is packed causal documents
    even when the row is padded after them (a padded row's own mask says None)."""
    if mask.batch != 1 or mask.heads != 1:
        return None
    fms, fme = mask.fms[0, 0], mask.fme[0, 0]
    n = fms.shape[0]
    cols = torch.arange(n, device=mask.device, dtype=fms.dtype)
    ends = fme[:, 0] == cols
    next_end = torch.flip(torch.cummin(torch.flip(torch.where(ends, cols, n), (0,)), 0).values, (0,))
    causal = (fms[:, 0] == cols) & (fme[:, 0] == next_end)
    if fms.shape[1] > 1:
        causal &= (fms[:, 1:] > fme[:, 1:]).all(1)
    both = torch.stack([causal, ends]).cpu().tolist()
    return both[0], both[1]


def _cumsum(xs):
    total, out = 0, []
    for x in xs:
        total += x
        out.append(total)
    return out


def _local_mask(mask: FlashMask, r0: int, r1: int, doc_ends) -> FlashMask:
    """Rows and keys ``[r0, r1)`` of ``mask`` renumbered from 0 (empty intervals canonical)."""
    n = r1 - r0
    fms, fme = mask.fms[:, :, r0:r1], mask.fme[:, :, r0:r1]
    empty = fms > fme
    sub = FlashMask(torch.where(empty, n, fms - r0), torch.where(empty, -1, fme - r0), n, validate=False)
    if doc_ends is not None:  # the parent's documents inside the chunk (its ends are document ends)
        inside = [e - r0 for e in doc_ends if r0 <= e <= r1]
        sub.set_causal_documents(tuple(b - a for a, b in zip(inside, inside[1:])))
    return sub


# ------------------------------------------------------------------------------ decoder layers
class _Parts:
    """The per-token parts of one Llama-shaped layer, on tiles ``x [B, t, hidden]``; q / k / v come
    out as ``[B, t, H, D]``."""

    def __init__(self, layer):
        self.layer = layer
        self.attn = attn = layer.self_attn
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3-style

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(*t.shape[:-1], -1, self.attn.head_dim)

    def query(self, x, cos, sin):
        q = self._heads(self.attn.q_proj(self.layer.input_layernorm(x)))
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.transpose(1, 2)
        q, _ = self.rope(q, q[:, :1], cos, sin)  # the model's own rotary (its layout); one head as the dummy key
        return q.transpose(1, 2)

    def keys(self, x, cos, sin):
        h = self.layer.input_layernorm(x)
        k, v = self._heads(self.attn.k_proj(h)), self._heads(self.attn.v_proj(h))
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = k.transpose(1, 2)
        _, k = self.rope(k[:, :1], k, cos, sin)
        return k.transpose(1, 2), v

    def all(self, x, cos, sin):
        q = self.query(x, cos, sin)
        k, v = self.keys(x, cos, sin)
        return q, k, v

    def output(self, x, o):
        """``o [B, t, Hq * D]`` -> the layer's output tile."""
        h = x + self.attn.o_proj(o)
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))


@dataclass
class _Call:
    """One layer call: what the tiles and the attention need besides ``x``."""

    parts: _Parts
    tile: int
    cos: torch.Tensor
    sin: torch.Tensor
    attention: "_ChunkedAttention | _WholeAttention"
    params: list
    autocast: _Autocast

    def rope(self, a, b):
        return self.cos[:, a:b], self.sin[:, a:b]


class _ChunkedAttention:
    """FlashMask attention per query chunk through the backend's launchers (no context parallelism)."""

    def __init__(self, mask: FlashMask, impl: str, chunk_rows: int, scale: float):
        self.chunks, self.overlap = attention_chunks(mask, chunk_rows)
        self.backend, self.scale = backends.get(impl), scale

    def forward(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        k, v = _keys(call, x)
        y = torch.empty_like(x)
        for c in self.chunks:
            o, _, _ = self._attend(call, x, k, v, c)
            for a, b in _tiles(c.r0, c.r1, call.tile):
                y[:, a:b] = call.parts.output(x[:, a:b], o[:, a - c.r0 : b - c.r0].flatten(2))
        return y

    def _attend(self, call, x, k, v, c: AttentionChunk):
        """``(o [B, n, Hq, Dv], lse, q)`` of chunk ``c`` (no gradient)."""
        q = _per_tile(lambda a, b: call.parts.query(x[:, a:b], *call.rope(a, b)), c.r0, c.r1, call.tile)
        if c.mask is None:  # rows that see no key: zero output (as every backend gives them)
            o = q.new_zeros(*q.shape[:3], v.shape[-1])
            return o, None, q
        o, lse = self.backend.forward(q.transpose(1, 2), k[:, c.k0:c.k1].transpose(1, 2), v[:, c.k0:c.k1].transpose(1, 2),
                                      c.mask, c.positions, self.scale, q_offset=c.q_offset)
        return o.transpose(1, 2), lse, q

    def backward(self, call: _Call, x, dy, grads: _Grads, dx):
        k, v = _keys(call, x)
        acc = torch.float32 if self.overlap and k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
        for c in self.chunks:
            o_full, lse, q = self._attend(call, x, k, v, c)
            o = o_full.to(x.dtype) if o_full.dtype != x.dtype else o_full
            do = torch.empty(o.shape, dtype=o.dtype, device=o.device)
            for a, b in _tiles(c.r0, c.r1, call.tile):  # the output part: dx, do
                x_l, o_l = _leaf(x[:, a:b], dx is not None), _leaf(o[:, a - c.r0 : b - c.r0].flatten(2), True)
                with torch.enable_grad(), call.autocast():
                    y = call.parts.output(x_l, o_l)
                gx, go = grads(y, dy[:, a:b], [x_l, o_l])
                if dx is not None:
                    dx[:, a:b] = gx
                do[:, a - c.r0 : b - c.r0] = go.view(do[:, a - c.r0 : b - c.r0].shape)
            del o
            if c.mask is None:
                dq = torch.zeros_like(q)
            else:
                dq, dk_w, dv_w = self.backend.backward(
                    q.transpose(1, 2), k[:, c.k0:c.k1].transpose(1, 2), v[:, c.k0:c.k1].transpose(1, 2),
                    o_full.transpose(1, 2), lse, do.transpose(1, 2), c.mask, c.positions, self.scale, q_offset=c.q_offset)
                dq = dq.transpose(1, 2)
                dk[:, c.k0:c.k1] += dk_w.transpose(1, 2)
                dv[:, c.k0:c.k1] += dv_w.transpose(1, 2)
                del dk_w, dv_w
            del o_full, lse, do, q
            for a, b in _tiles(c.r0, c.r1, call.tile):  # the query part
                x_l = _leaf(x[:, a:b], dx is not None)
                with torch.enable_grad(), call.autocast():
                    q_t = call.parts.query(x_l, *call.rope(a, b))
                (gx,) = grads(q_t, dq[:, a - c.r0 : b - c.r0], [x_l])
                if dx is not None:
                    dx[:, a:b] += gx
            del dq
        del k, v
        dk, dv = dk.to(x.dtype), dv.to(x.dtype)
        _keys_backward(call, x, dk, dv, grads, dx)


class _WholeAttention:
    """The layer's own attention function over the whole sequence (context parallelism, the SDPA /
    Flex baselines, padding masks): q, k, v and the output exist whole; autograd differentiates it."""

    def __init__(self, fn, kwargs: dict):
        self.fn, self.kwargs = fn, kwargs

    def _run(self, call, q, k, v):
        attn = call.parts.attn
        o, _ = self.fn(attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.kwargs.get("attention_mask"),
                       dropout=0.0, scaling=attn.scaling,
                       **{key: val for key, val in self.kwargs.items() if key != "attention_mask"})
        return o.reshape(*o.shape[:2], -1)  # [B, N, Hq * Dv]

    def forward(self, call: _Call, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _queries_and_keys(call, x)
        o = self._run(call, q, k, v)
        del q, k, v
        y = torch.empty_like(x)
        for a, b in _tiles(0, x.shape[1], call.tile):
            y[:, a:b] = call.parts.output(x[:, a:b], o[:, a:b])
        return y

    def backward(self, call: _Call, x, dy, grads: _Grads, dx):
        q, k, v = (_leaf(t, True) for t in _queries_and_keys(call, x))
        with torch.enable_grad(), call.autocast():
            o = self._run(call, q, k, v)
        do = torch.empty_like(o)
        for a, b in _tiles(0, x.shape[1], call.tile):
            x_l, o_l = _leaf(x[:, a:b], dx is not None), _leaf(o[:, a:b], True)
            with torch.enable_grad(), call.autocast():
                y = call.parts.output(x_l, o_l)
            gx, go = grads(y, dy[:, a:b], [x_l, o_l])
            if dx is not None:
                dx[:, a:b] = gx
            do[:, a:b] = go
        dq, dk, dv = torch.autograd.grad(o, [q, k, v], do)
        del o, do, q, k, v
        for a, b in _tiles(0, x.shape[1], call.tile):
            x_l = _leaf(x[:, a:b], dx is not None)
            with torch.enable_grad(), call.autocast():
                out = call.parts.all(x_l, *call.rope(a, b))
            (gx,) = grads(out, (dq[:, a:b], dk[:, a:b], dv[:, a:b]), [x_l])
            if dx is not None:
                dx[:, a:b] += gx


def _per_tile(fn, r0: int, r1: int, tile: int):
    """``fn(a, b)`` over the tiles of rows ``[r0, r1)``, each output (a tensor or a tuple of them,
    ``[B, t, ...]``) written into one ``[B, r1 - r0, ...]`` buffer: no concatenation copy."""
    out = None
    for a, b in _tiles(r0, r1, tile):
        part = fn(a, b)
        single = isinstance(part, torch.Tensor)
        parts = (part,) if single else part
        if out is None:
            out = [p.new_empty(p.shape[0], r1 - r0, *p.shape[2:]) for p in parts]
        for buf, p in zip(out, parts):
            buf[:, a - r0 : b - r0] = p
    return out[0] if single else tuple(out)


def _keys(call: _Call, x):
    """k ``[B, N, Hkv, D]`` and v ``[B, N, Hkv, Dv]`` of the whole sequence, tile by tile."""
    return _per_tile(lambda a, b: call.parts.keys(x[:, a:b], *call.rope(a, b)), 0, x.shape[1], call.tile)


def _queries_and_keys(call: _Call, x):
    return _per_tile(lambda a, b: call.parts.all(x[:, a:b], *call.rope(a, b)), 0, x.shape[1], call.tile)


def _keys_backward(call: _Call, x, dk, dv, grads: _Grads, dx):
    for a, b in _tiles(0, x.shape[1], call.tile):
        x_l = _leaf(x[:, a:b], dx is not None)
        with torch.enable_grad(), call.autocast():
            kt, vt = call.parts.keys(x_l, *call.rope(a, b))
        (gx,) = grads((kt, vt), (dk[:, a:b], dv[:, a:b]), [x_l])
        if dx is not None:
            dx[:, a:b] += gx


class TiledLayer(torch.autograd.Function):
    """A decoder layer as its own activation checkpoint: it saves ``x`` only (through the
    saved-tensor hooks around it, so :class:`~fm_parallel.trainer.memory.HostOffload` moves exactly
    that to the host) and recomputes the rest tile by tile in the backward."""

    @staticmethod
    def forward(ctx, call: _Call, x, *params):
        ctx.call = call
        ctx.save_for_backward(x)
        with call.autocast():
            return call.attention.forward(call, x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        call = ctx.call
        grads = _Grads(call.params)
        dx = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        dy = dy.contiguous()
        call.attention.backward(call, x, dy, grads, dx)
        return (None, dx, *grads.sums)


def _attention_function(attn):
    """The attention implementation the model is configured with (ours, sdpa, flex, eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = attn.config._attn_implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(attn).__module__].eager_attention_forward


def _chunkable(attn, x, kwargs) -> tuple[FlashMask, str] | None:
    """The mask and backend when the attention can run per query chunk through the launchers: our
    attention, a FlashMask on x's device, no context, no padding or 4-D mask, no sliding window."""
    from fm_parallel.integrations.transformers import NAME

    mask = kwargs.get("flashmask")
    if (attn.config._attn_implementation != NAME or not isinstance(mask, FlashMask) or mask.device != x.device
            or kwargs.get("fm_context") is not None or kwargs.get("attention_mask") is not None
            or getattr(attn, "sliding_window", None) is not None or mask.num_keys != x.shape[1]
            or mask.batch not in (1, x.shape[0]) or any(kwargs.get(k) is not None for k in ("fms", "fme", "s_aux", "softcap"))):
        return None
    d, dv = attn.head_dim, attn.head_dim
    try:
        impl = backends.resolve(kwargs.get("fm_impl", "auto"), x.device, x.dtype, d, dv, chunked=True)
    except ValueError:
        return None  # the whole-sequence path raises the same error where it belongs (attention_forward)
    return mask, impl


def _tiled_forward(layer, tile: int, attention_chunk: int, original):
    parts = _Parts(layer)
    attn = layer.self_attn

    def forward(hidden_states, attention_mask=None, position_ids=None, *args, position_embeddings=None, **kwargs):
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        params = _trainable(layer)
        if (cached or position_embeddings is None or args or not torch.is_grad_enabled()
                or not (hidden_states.requires_grad or params)):
            return original(hidden_states, attention_mask, position_ids, *args, position_embeddings=position_embeddings, **kwargs)
        if layer.training and (getattr(attn, "attention_dropout", 0.0)
                               or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in layer.modules())):
            raise ValueError("model.tile_chunk: expected no dropout in a tiled decoder layer (its tiles are "
                             "recomputed in the backward), got dropout > 0; set model.tile_chunk = 0")
        for key in ("cache", "past_key_values", "use_cache", "cache_position"):
            kwargs.pop(key, None)
        x = hidden_states
        cos, sin = position_embeddings
        whole = dict(kwargs, attention_mask=attention_mask, position_ids=position_ids)
        if getattr(attn, "sliding_window", None) is not None:
            whole.setdefault("sliding_window", attn.sliding_window)
        chunkable = _chunkable(attn, x, whole) if attention_chunk else None
        if chunkable is not None:
            attention = _ChunkedAttention(*chunkable, attention_chunk, attn.scaling)
        else:
            attention = _WholeAttention(_attention_function(attn), whole)
        call = _Call(parts, tile, cos, sin, attention, params, _Autocast(x.device))
        return TiledLayer.apply(call, x, *params)

    return forward


def tile_decoder_layers(model, tile: int, attention_chunk: int = 65536) -> int:
    """Make each decoder layer a :class:`TiledLayer` (per-token parts over ``tile`` tokens, FlashMask
    attention over query chunks of at most ``attention_chunk`` rows; 0: one call over the whole
    sequence), and tile the final norm. The layers are then their own activation checkpoints.
    Returns the number of layers tiled; a layer that is not Llama-shaped raises ``ValueError`` naming
    what is missing."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"chunk: expected a positive number of tokens, got {tile}")
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise ValueError(f"attention_chunk: expected a number of query rows >= 0 (0: the whole sequence), got {attention_chunk!r}")
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:  # older decoder layers return tuples, not the hidden state
        raise ValueError(f"model.tile_chunk: expected transformers >= 5, got {transformers.__version__}; set model.tile_chunk = 0")
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        missing = [a for a in _NEEDED if not hasattr(layer, a)]
        missing += [f"self_attn.{a}" for a in _ATTENTION_NEEDED if hasattr(layer, "self_attn") and not hasattr(layer.self_attn, a)]
        if missing:
            raise ValueError(f"model.tile_chunk: expected Llama-shaped decoder layers, layer {i} "
                             f"({type(layer).__name__}) has no {', '.join(missing)}; set model.tile_chunk = 0")
        original = layer.__dict__.get("_fm_untiled_forward", layer.forward)
        layer._fm_untiled_forward = original
        layer.forward = _tiled_forward(layer, tile, attention_chunk, original)
        layer._fm_self_checkpointed = True  # checkpoint_layers must not wrap it in a second checkpoint
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", base), "norm", None)
    if isinstance(norm, torch.nn.Module):
        forward = norm.__dict__.get("_fm_untiled_forward", norm.forward)
        norm._fm_untiled_forward = forward
        norm.forward = lambda x, _f=forward, _n=norm: tiled_map(_f, x, tile, params=_trainable(_n))
    return len(layers)
