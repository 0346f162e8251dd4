"""Sequence tiling of a decoder layer's per-token work, so that at long context a layer's backward
holds a few ``N x hidden`` tensors instead of dozens.

A Llama-family decoder layer is per-token everywhere except inside attention: RMSNorm, the q/k/v
projections (with their LoRA adapters), the rotary embedding, the output projection, the residuals
and the MLP all act on each token alone. Run as written, their intermediates are saved for the
backward for the whole sequence at once (RMSNorm alone keeps two float32 copies of its input).
Tiled, each of the two per-token blocks runs over chunks of ``chunk`` tokens under non-reentrant
checkpointing, so what a layer keeps is its input, q / k / v and the attention output. Measured: the
tensors saved per token and layer drop from 29 to 5.5 hidden-sized values (bf16, CPU probe in
tests/trainer/test_memory.py); an 8B-shaped Llama's non-checkpoint memory at the step's peak on the
H200 drops from 213 to 105 KiB per token, which is what made a 512k-token step fit (docs/long-context.md).
The result is the same computation (losses equal to the untiled layer's, tested on the CPU).

    prologue(x) = rope(q_proj(norm1(x))), rope(k_proj(norm1(x))), v_proj(norm1(x))     per chunk
    o           = attention(q, k, v, mask)                                           whole sequence
    epilogue    = h + mlp(norm2(h)),  h = x + o_proj(o)                              per chunk
"""

from __future__ import annotations

import sys

import torch
from torch.utils.checkpoint import checkpoint

from fm_parallel.trainer.memory import decoder_layers

__all__ = ["tile_decoder_layers"]

_NEEDED = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_NEEDED = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


def _attention_function(attn):
    """The attention implementation the model is configured with (ours, sdpa, flex, eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = attn.config._attn_implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(attn).__module__].eager_attention_forward


def _tiled_forward(layer, chunk: int, original):
    attn = layer.self_attn
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3-style per-head norms

    def prologue(x, cos, sin):
        h = layer.input_layernorm(x)
        shape = (*h.shape[:-1], -1, attn.head_dim)
        q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, attn.v_proj(h).view(shape).transpose(1, 2)

    def epilogue(x, o):
        h = x + attn.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def forward(hidden_states, attention_mask=None, position_ids=None, *args, position_embeddings=None, **kwargs):
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if cached or position_embeddings is None or args or not torch.is_grad_enabled():
            return original(hidden_states, attention_mask, position_ids, *args, position_embeddings=position_embeddings, **kwargs)
        for key in ("cache", "past_key_values", "use_cache", "cache_position"):
            kwargs.pop(key, None)
        x, (cos, sin) = hidden_states, position_embeddings
        n = x.shape[1]
        parts = [checkpoint(prologue, x[:, c : c + chunk], cos[:, c : c + chunk], sin[:, c : c + chunk], use_reentrant=False)
                 for c in range(0, n, chunk)]
        q, k, v = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
        del parts
        if hasattr(attn, "sliding_window"):
            kwargs.setdefault("sliding_window", attn.sliding_window)
        o, _ = _attention_function(attn)(attn, q, k, v, attention_mask, dropout=attn.attention_dropout if layer.training else 0.0,
                                         scaling=attn.scaling, position_ids=position_ids, **kwargs)
        o = o.reshape(*x.shape[:-1], -1)
        return torch.cat([checkpoint(epilogue, x[:, c : c + chunk], o[:, c : c + chunk], use_reentrant=False)
                          for c in range(0, n, chunk)], dim=1)

    return forward


def _tile_per_token(module: torch.nn.Module, chunk: int) -> None:
    """Run a per-token module (the final norm) over checkpointed sequence chunks: it then saves its
    input chunks (views) for the backward instead of its float32 intermediates for the whole sequence."""
    forward = module.forward

    def tiled(x):
        if x.shape[1] <= chunk or not torch.is_grad_enabled():
            return forward(x)
        return torch.cat([checkpoint(forward, x[:, c : c + chunk], use_reentrant=False) for c in range(0, x.shape[1], chunk)], dim=1)

    module.forward = tiled


def tile_decoder_layers(model, chunk: int) -> int:
    """Replace each decoder layer's forward by the tiled one (chunks of ``chunk`` tokens), and tile the
    final norm. Returns the number of layers tiled; a layer that is not Llama-shaped raises
    ``ValueError`` naming what is missing."""
    if chunk <= 0:
        raise ValueError(f"chunk: expected a positive number of tokens, got {chunk}")
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
        layer.forward = _tiled_forward(layer, chunk, layer.forward)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, "model", base), "norm", None)
    if isinstance(norm, torch.nn.Module):
        _tile_per_token(norm, chunk)
    return len(layers)
