"""Hugging Face backend: every attention layer of a transformers model runs FlashMask attention.

    from fm_parallel.integrations import transformers as fm_hf
    name = fm_hf.register()                                   # "fm_parallel"; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    out = model(input_ids, flashmask=mask)                    # or fms=..., fme=...; fm_impl="triton" etc.
    out = model(ids_local, position_ids=plan.position_ids(rank), flashmask=mask,
                fm_context=ContextParallel("ring", plan))     # context parallel

The mask travels as a keyword argument (transformers forwards unknown keyword arguments to the
attention function, through peft too), so no N x N mask is ever built: the name registers a mask
function that hands over only the 2-D padding mask, which is folded into the FlashMask (padding keys
are seen by no row). Without a FlashMask the layer is causal (or bidirectional when the module says
``is_causal = False``). The name avoids "flash": transformers treats such names as FlashAttention.
"""

from __future__ import annotations

import functools

import torch

from fm_parallel.attention import flashmask_attention
from fm_parallel.masks import builders
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fm_parallel"


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for our name: pass on the 2-D padding mask ``[B, S]`` (or None), never a 4-D one."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


def register(name: str = NAME) -> str:
    """Register the attention function and its mask function under ``name``; calling again is harmless."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if "flash" in name.lower():
        raise ValueError(f"name: expected no 'flash' in it (transformers reserves those), got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _padding_mask)
    return name


@functools.lru_cache(maxsize=8)
def _default_mask(n_keys: int, causal: bool, device: torch.device) -> FlashMask:
    """The mask of a call that brings none, built once per length and device, not once per layer and
    step (built on the CPU, so a causal one knows it is causal: FA4's causal kernel under impl="cute")."""
    return (builders.causal(n_keys) if causal else builders.full(n_keys)).to(device)


def _with_padding(mask: FlashMask, padding: torch.Tensor) -> FlashMask:
    """Make padding keys (``padding[b, j]`` False) invisible to every row."""
    b = padding.shape[0]
    pad = ~padding.to(mask.device).view(b, 1, -1, 1)
    fms = mask.fms.expand(b, *mask.fms.shape[1:])
    fme = mask.fme.expand(b, *mask.fme.shape[1:])
    return FlashMask(torch.where(pad, mask.num_rows, fms), torch.where(pad, -1, fme), mask.num_rows, validate=False)


def attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    flashmask: FlashMask | None = None,
    fms: torch.Tensor | None = None,
    fme: torch.Tensor | None = None,
    fm_context=None,
    fm_impl: str = "auto",
    **kwargs,
):
    """transformers attention function: ``query [B, Hq, S, D]``, ``key/value [B, Hkv, S, D]`` ->
    ``(out [B, S, Hq, D], None)``. ``fm_impl``: the kernel without context parallelism (as
    ``flashmask_attention``'s ``impl``); a ``fm_context`` brings its own."""
    if dropout:
        raise ValueError(f"dropout: expected 0.0 (attention dropout is not supported), got {dropout}")
    if flashmask is None and fms is not None:
        flashmask = FlashMask(fms.to(query.device), fme.to(query.device), validate=False)
    n_keys = key.shape[2] if fm_context is None else fm_context.plan.num_tokens
    if flashmask is None:
        causal = getattr(module, "is_causal", True)
        flashmask = _default_mask(n_keys, bool(causal), query.device)
    elif flashmask.device != query.device:
        flashmask = flashmask.to(query.device)
    if attention_mask is not None and attention_mask.dim() == 2:
        if fm_context is not None:
            raise ValueError("attention_mask: padding under context parallelism must be in the FlashMask, got a 2-D mask")
        flashmask = _with_padding(flashmask, attention_mask)
    if fm_context is None:
        out = flashmask_attention(query, key, value, mask=flashmask, scale=scaling, impl=fm_impl)
    else:
        out = fm_context.attention(query, key, value, flashmask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None
