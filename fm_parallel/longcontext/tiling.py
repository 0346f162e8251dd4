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
(:func:`fm_parallel.masks.chunks.attention_chunks`: chunks of at most ``attention_chunk`` rows cut
where no visibility crosses, e.g. between packed documents, each with the window of keys its rows see). Then the full
q, the attention output and its gradient never exist: the backward holds x, its gradient, dy, k, v
and their gradients, plus one chunk's q / o / do / dq and the kernel's workspace for it. A chunk cut
between documents is an independent problem (local rows: FA4 runs its varlen kernel on it), and its
keys' gradients come from it alone; chunks whose key windows overlap add theirs in float32. Under
context parallelism, or with the SDPA / Flex baselines, the attention runs over the whole sequence
(:class:`_WholeAttention`: the layer's own attention function, differentiated by autograd).

Measured (docs/long-context.md): an 8B-shaped Llama's memory beyond the checkpoints at the step's peak
on the H200 went from 213 (untiled) to 105 (tiled per-token parts, whole-sequence attention) to the
figure given there with chunked attention. Exact: float64 losses and LoRA gradients equal to the
untiled layer's (tests/longcontext/test_tiling.py).

The tiles' machinery (and :func:`~.tiles.tiled_map` / :func:`~.tiles.tiled_sum` for the final norm and
the loss) is :mod:`.tiles`.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from fm_parallel import backends
from fm_parallel.masks.chunks import AttentionChunk, attention_chunks
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.longcontext.memory import decoder_layers, unwrapped_forward
from fm_parallel.longcontext.tiles import (AutocastState, TileGrads, detached_leaf, per_tile, tile_ranges, tiled_map,
                                       trainable_parameters)

__all__ = ["tile_decoder_layers", "untile_decoder_layers", "TiledLayer"]

_NEEDED = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_NEEDED = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


class _Parts:
    """The per-token parts of one Llama-shaped layer, on tiles ``x [B, t, hidden]``; q / k / v come
    out as ``[B, t, H, D]``.

    ``compiled``: the query, key and output parts run through ``torch.compile`` (Inductor fuses the
    norms, rotary, SiLU gate, residual adds and LoRA's casts and adds, which run as dozens of separate
    memory-bound kernels otherwise: 45% of a long 8B step's GPU time, docs/long-context.md). One
    compiled function per part serves every layer (the layer is an argument, its parameters graph
    inputs), with the tile length dynamic from the start: its graphs are the forward's (no gradient) and
    the backward's (with or without the input's gradient), whatever the tile, chunk or layer."""

    def __init__(self, layer, compiled: bool = False):
        self.layer = layer
        self.attn = attn = layer.self_attn
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3-style
        if compiled:
            self.query = functools.partial(_compiled("query"), self)
            self.keys = functools.partial(_compiled("keys"), self)
            self.output = functools.partial(_compiled("output"), self)

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


@functools.cache
def _compiled(part: str):
    """``torch.compile`` of the unbound ``_Parts`` method ``part``: made once per process, so its graphs
    are shared by every layer and every call. Dynamic shapes from the start: the tiles' lengths vary
    (a chunk's last tile), and a graph per length (each times grad mode) would pass Dynamo's
    recompile limit (8) and fall back to eager for the rest, as it did on the first GPU run."""
    compiled = torch.compile(getattr(_Parts, part), dynamic=True)

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:  # a model's layer torch.compile cannot take
            raise RuntimeError(f"model.compile: torch.compile failed on the tiled layers' {part} part "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                               "set model.compile = 'off' to run them eagerly") from e

    return run


@dataclass
class _Call:
    """One layer call: what the tiles and the attention need besides ``x``."""

    parts: _Parts
    tile: int
    cos: torch.Tensor
    sin: torch.Tensor
    attention: "_ChunkedAttention | _WholeAttention"
    params: list
    autocast: AutocastState

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
            for a, b in tile_ranges(c.r0, c.r1, call.tile):
                y[:, a:b] = call.parts.output(x[:, a:b], o[:, a - c.r0 : b - c.r0].flatten(2))
        return y

    def _attend(self, call, x, k, v, c: AttentionChunk):
        """``(o [B, n, Hq, Dv], lse, q)`` of chunk ``c`` (no gradient)."""
        q = per_tile(lambda a, b: call.parts.query(x[:, a:b], *call.rope(a, b)), c.r0, c.r1, call.tile)
        if c.mask is None:  # rows that see no key: zero output (as every backend gives them)
            o = q.new_zeros(*q.shape[:3], v.shape[-1])
            return o, None, q
        o, lse = self.backend.forward(q.transpose(1, 2), k[:, c.k0:c.k1].transpose(1, 2), v[:, c.k0:c.k1].transpose(1, 2),
                                      c.mask, c.positions, self.scale, q_offset=c.q_offset)
        return o.transpose(1, 2), lse, q

    def backward(self, call: _Call, x, dy, grads: TileGrads, dx):
        k, v = _keys(call, x)
        acc = torch.float32 if self.overlap and k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
        for c in self.chunks:
            o_full, lse, q = self._attend(call, x, k, v, c)
            o = o_full.to(x.dtype) if o_full.dtype != x.dtype else o_full
            do = torch.empty(o.shape, dtype=o.dtype, device=o.device)
            for a, b in tile_ranges(c.r0, c.r1, call.tile):  # the output part: dx, do
                x_l, o_l = detached_leaf(x[:, a:b], dx is not None), detached_leaf(o[:, a - c.r0 : b - c.r0].flatten(2), True)
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
            for a, b in tile_ranges(c.r0, c.r1, call.tile):  # the query part
                x_l = detached_leaf(x[:, a:b], dx is not None)
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
        for a, b in tile_ranges(0, x.shape[1], call.tile):
            y[:, a:b] = call.parts.output(x[:, a:b], o[:, a:b])
        return y

    def backward(self, call: _Call, x, dy, grads: TileGrads, dx):
        q, k, v = (detached_leaf(t, True) for t in _queries_and_keys(call, x))
        with torch.enable_grad(), call.autocast():
            o = self._run(call, q, k, v)
        do = torch.empty_like(o)
        for a, b in tile_ranges(0, x.shape[1], call.tile):
            x_l, o_l = detached_leaf(x[:, a:b], dx is not None), detached_leaf(o[:, a:b], True)
            with torch.enable_grad(), call.autocast():
                y = call.parts.output(x_l, o_l)
            gx, go = grads(y, dy[:, a:b], [x_l, o_l])
            if dx is not None:
                dx[:, a:b] = gx
            do[:, a:b] = go
        dq, dk, dv = torch.autograd.grad(o, [q, k, v], do)
        del o, do, q, k, v
        for a, b in tile_ranges(0, x.shape[1], call.tile):
            x_l = detached_leaf(x[:, a:b], dx is not None)
            with torch.enable_grad(), call.autocast():
                out = call.parts.all(x_l, *call.rope(a, b))
            (gx,) = grads(out, (dq[:, a:b], dk[:, a:b], dv[:, a:b]), [x_l])
            if dx is not None:
                dx[:, a:b] += gx


def _keys(call: _Call, x):
    """k ``[B, N, Hkv, D]`` and v ``[B, N, Hkv, Dv]`` of the whole sequence, tile by tile."""
    return per_tile(lambda a, b: call.parts.keys(x[:, a:b], *call.rope(a, b)), 0, x.shape[1], call.tile)


def _queries_and_keys(call: _Call, x):
    return per_tile(lambda a, b: call.parts.all(x[:, a:b], *call.rope(a, b)), 0, x.shape[1], call.tile)


def _keys_backward(call: _Call, x, dk, dv, grads: TileGrads, dx):
    for a, b in tile_ranges(0, x.shape[1], call.tile):
        x_l = detached_leaf(x[:, a:b], dx is not None)
        with torch.enable_grad(), call.autocast():
            kt, vt = call.parts.keys(x_l, *call.rope(a, b))
        (gx,) = grads((kt, vt), (dk[:, a:b], dv[:, a:b]), [x_l])
        if dx is not None:
            dx[:, a:b] += gx


class TiledLayer(torch.autograd.Function):
    """A decoder layer as its own activation checkpoint: it saves ``x`` only (through the
    saved-tensor hooks around it, so :class:`~fm_parallel.longcontext.memory.HostOffload` moves exactly
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
        grads = TileGrads(call.params)
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


def _tiled_forward(layer, tile: int, attention_chunk: int, original, compiled: bool):
    parts = _Parts(layer, compiled)
    attn = layer.self_attn

    def forward(hidden_states, attention_mask=None, position_ids=None, *args, position_embeddings=None, **kwargs):
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        params = trainable_parameters(layer)
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
        call = _Call(parts, tile, cos, sin, attention, params, AutocastState(x.device))
        return TiledLayer.apply(call, x, *params)

    return forward


def tile_decoder_layers(model, tile: int, attention_chunk: int = 65536, compiled: bool = False) -> int:
    """Make each decoder layer a :class:`TiledLayer` (per-token parts over ``tile`` tokens, FlashMask
    attention over query chunks of at most ``attention_chunk`` rows; 0: one call over the whole
    sequence), and tile the final norm. The layers are then their own activation checkpoints.
    ``compiled``: the per-token parts through ``torch.compile`` (:class:`_Parts`).
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
        original = layer.__dict__.get("_fm_untiled_forward") or unwrapped_forward(layer)
        layer._fm_untiled_forward = original
        layer.forward = _tiled_forward(layer, tile, attention_chunk, original, compiled)
        layer._fm_self_checkpointed = True  # checkpoint_layers must not wrap it in a second checkpoint
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", base), "norm", None)
    if isinstance(norm, torch.nn.Module):
        forward = norm.__dict__.get("_fm_untiled_forward", norm.forward)
        norm._fm_untiled_forward = forward
        norm.forward = lambda x, _f=forward, _n=norm: tiled_map(_f, x, tile, params=trainable_parameters(_n))
    return len(layers)


def untile_decoder_layers(model) -> int:
    """Undo :func:`tile_decoder_layers`: each tiled layer (and the final norm) gets the forward it had
    before; checkpoints wrapped around the tiled layers go with them (apply them again). Returns the
    number of layers untiled."""
    untiled = 0
    for layer in decoder_layers(model):
        original = layer.__dict__.pop("_fm_untiled_forward", None)
        if original is None:
            continue
        layer.forward = original
        for name in ("_fm_self_checkpointed", "_fm_checkpoint_forward", "_fm_unwrapped_forward"):
            layer.__dict__.pop(name, None)
        untiled += 1
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", base), "norm", None)
    if isinstance(norm, torch.nn.Module) and "_fm_untiled_forward" in norm.__dict__:
        norm.forward = norm.__dict__.pop("_fm_untiled_forward")
    return untiled
