"""Hugging Face backend: every attention layer of a transformers model runs FlashMask attention.

    from fm_parallel.integrations import transformers as fm_hf
    name = fm_hf.register()                                   # "fm_parallel"; idempotent
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    out = model(input_ids, flashmask=mask)                    # or fms=..., fme=...; fm_impl="triton" etc.
    out = model(**DataCollatorWithFlattening()(examples))     # packed rows: the mask comes from the kwargs
    out = model(ids_local, position_ids=plan.position_ids(rank), flashmask=mask,
                fm_context=ContextParallel("ring", plan))     # context parallel

The mask travels as a keyword argument (transformers forwards unknown keyword arguments to the
attention function, through peft too), so no N x N mask is ever built: the name registers a mask
function that hands over only the 2-D padding mask, which is folded into the FlashMask (padding keys
are seen by no row). When no FlashMask is given, the layer uses what the ecosystem already passes:

* ``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, TRL padding-free):
  packed documents with those boundaries;
* else ``position_ids`` whose value does not increase by one (a new document starts there), as
  transformers' own ``sdpa`` path reads them;
* else causal (or bidirectional when the module says ``is_causal = False``).

The derived mask is built once per forward (cached on the tensors it came from, reused by every
layer) without a device sync for ``position_ids``. With fewer queries than keys (a KV cache in
``generate()``) the queries are the last rows (bottom-right alignment, as ``sdpa`` and flash-attn do).
Under ``torch.autocast`` q, k, v are computed in the autocast dtype, as ``sdpa`` does. Layers with a
``sliding_window`` get it intersected into the mask; attention sinks (``s_aux``) and logit soft-capping
are refused rather than ignored. The name avoids "flash": transformers treats such names as
FlashAttention.
"""

from __future__ import annotations

import functools

import torch

from fm_parallel.attention import autocast_inputs, flashmask_attention
from fm_parallel.derived import IdentityCache
from fm_parallel.masks import builders
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fm_parallel"


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """Mask function for our name: the 2-D key mask ``[B, kv_length]`` (True = a real key), never a
    4-D one; None when every key is real and the queries are the last rows of the keys (no cache, or a
    dynamic cache). Otherwise (padding, or a static cache whose unfilled slots follow the queries) the
    returned mask also carries where the queries sit among the keys (``_fm_rows_offset``)."""
    rows_offset = int(q_offset) - int(kv_offset)
    bottom_right = rows_offset == kv_length - q_length
    if attention_mask is not None:
        attention_mask = attention_mask[:, kv_offset : kv_offset + kv_length]
    if (attention_mask is None or bool(attention_mask.all())) and bottom_right and (
            attention_mask is None or attention_mask.shape[-1] == kv_length):
        return None
    keys = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
    if attention_mask is not None:
        keys = keys.to(attention_mask.device)
        keys[:, : attention_mask.shape[-1]] = padding_keep(attention_mask)
    keys[:, rows_offset + q_length :] = False  # static-cache slots not written yet: no query may see them
    keys._fm_rows_offset = rows_offset
    return keys


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


# Each layer of one forward receives the same position_ids / cu_seq_lens / padding tensors: what is
# derived from them is built by the first layer and reused by the rest (one entry: the last forward's).
_DERIVED = IdentityCache("HF attention: the mask from position_ids / cu_seq_lens", entries=1)


def _documents_from_positions(position_ids: torch.Tensor, batch: int, n: int, causal: bool, device) -> FlashMask:
    """Packed documents where ``position_ids [B|1, n]`` restart (a step other than +1), on the
    tensor's own device without a sync: ``[B, 1, n]`` bounds."""
    pos = position_ids.to(device=device, dtype=torch.int64).reshape(-1, n).expand(batch, n)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = torch.arange(n, device=device).expand(batch, n)
    # The next document start strictly after each token (n if none): its document ends just before.
    after = torch.cat([torch.where(starts, idx, n)[:, 1:], torch.full((batch, 1), n, device=device)], 1)
    end = torch.flip(torch.cummin(torch.flip(after, [1]), 1).values, [1]) - 1
    first = torch.cummax(torch.where(starts, idx, 0), 1).values  # this token's document start
    fms = (idx if causal else first).to(torch.int32)
    return FlashMask(fms[:, None, :, None].contiguous(), end.to(torch.int32)[:, None, :, None].contiguous(), n, validate=False)


def _documents_from_cu_seqlens(cu_q, cu_k, n: int, causal: bool, device) -> FlashMask:
    """Packed documents from flash-attn style boundaries ``[0, l0, l0 + l1, ..., n]`` (one row)."""
    bounds = cu_k.tolist()  # one host copy per forward (cached), so the mask knows its documents
    if cu_q is not None and cu_q is not cu_k and cu_q.tolist() != bounds:
        raise ValueError(f"cu_seq_lens_q: expected the boundaries of cu_seq_lens_k {bounds} (self-attention), got {cu_q.tolist()}")
    if not bounds or bounds[0] != 0 or bounds[-1] != n or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seq_lens_k: expected non-decreasing boundaries from 0 to the {n} packed tokens, got {bounds}")
    return builders.document(cu_seqlens=bounds, causal=causal).to(device)


def padding_keep(attention_mask: torch.Tensor) -> torch.Tensor:
    """A 2-D padding ``attention_mask [B, N]`` as bool (True: a real token), from every dtype Hugging
    Face uses: bool, int64 / int32 (what tokenizers and collators return), float 0 / 1. Any other value
    is refused (an additive float mask of 0 / -inf would read as all real)."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_complex() or not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
        raise ValueError(f"attention_mask: expected a 2-D padding mask of 1 (token) and 0 (padding), as bool, int or "
                         f"float, got {attention_mask.dtype} with the value {bad.flatten()[0].item()!r}")
    return attention_mask != 0


def _with_padding(mask: FlashMask, padding: torch.Tensor) -> FlashMask:
    """Make padding keys (``padding[b, j]`` 0 / False, any dtype :func:`padding_keep` takes) invisible to every row."""
    b = padding.shape[0]
    pad = ~padding_keep(padding).to(mask.device).view(b, 1, -1, 1)
    fms = mask.fms.expand(b, *mask.fms.shape[1:])
    fme = mask.fme.expand(b, *mask.fme.shape[1:])
    return FlashMask(torch.where(pad, mask.num_rows, fms), torch.where(pad, -1, fme), mask.num_rows, validate=False)


def _layer_mask(module, query, n_keys, attention_mask, position_ids, cu_q, cu_k, sliding_window) -> FlashMask:
    """The mask of a call that brings no FlashMask (see the module docstring), cached per forward."""
    causal = bool(getattr(module, "is_causal", True))
    batch, n_queries, device = query.shape[0], query.shape[2], query.device
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    same_length = n_queries == n_keys  # no KV-cache prefix: the packing can be read from the queries' positions

    def make() -> FlashMask:
        if cu_k is not None and same_length:
            mask = _documents_from_cu_seqlens(cu_q, cu_k, n_keys, causal, device)
        elif position_ids is not None and same_length and position_ids.shape[-1] == n_keys:
            mask = _documents_from_positions(position_ids, batch, n_keys, causal, device)
        else:
            mask = _default_mask(n_keys, causal, device)
        if sliding_window:
            mask = builders.intersect(mask, builders.sliding_window(n_keys, int(sliding_window)).to(device))
        return _with_padding(mask, padding) if padding is not None else mask

    sources = (cu_k if same_length else None, position_ids if same_length and cu_k is None else None, padding)
    return _DERIVED.get(sources, (n_keys, causal, batch, device, sliding_window), make)


def _caller_mask(flashmask, fms, fme, n_keys: int, device) -> FlashMask | None:
    """The mask the caller passed as ``flashmask=`` or raw ``fms=``/``fme=`` (None if neither), with
    ``flashmask_attention``'s checks: raw bounds ``[B|1, Hm, Nk(, M)]`` become a validated
    :class:`FlashMask` of ``n_keys`` rows (rows >= 0, below ``n_keys``, sorted disjoint intervals),
    built once per forward (every layer gets the same tensors) on ``device``."""
    if (fms is None) != (fme is None):
        raise ValueError("fms, fme: expected both or neither, got only " + ("fms" if fme is None else "fme"))
    if flashmask is not None:
        from fm_parallel.distributed.prepared import PreparedMask  # a context's step mask (the trainer passes it whole)

        if not isinstance(flashmask, (FlashMask, PreparedMask)):
            raise ValueError(f"flashmask: expected a FlashMask (fm_parallel.masks builders, or pass fms=/fme=; a dense "
                             f"mask goes in attention_mask= as [B, 1, Nq, Nk]), got {type(flashmask).__name__}")
        if fms is not None:
            raise ValueError("flashmask: expected a FlashMask or fms/fme, got both")
        return flashmask
    if fms is None:
        return None
    for name, t in (("fms", fms), ("fme", fme)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected an integer torch.Tensor [B, Hm, Nk] or [B, Hm, Nk, M], got {type(t).__name__}")

    def make() -> FlashMask:
        # validate=True: the caller's bounds are checked as flashmask_attention checks them (one sync per forward).
        mask = FlashMask(fms.to(device), fme.to(device), n_keys)
        if mask.num_keys != n_keys:
            raise ValueError(f"fms: expected {n_keys} key columns (the keys' length), got {mask.num_keys}")
        return mask

    return _CHECKED.get((fms, fme), (n_keys, device), make)


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
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """transformers attention function: ``query [B, Hq, Sq, D]``, ``key/value [B, Hkv, Sk, D]`` ->
    ``(out [B, Sq, Hq, D], None)``. ``fm_impl``: the kernel without context parallelism (as
    ``flashmask_attention``'s ``impl``); a ``fm_context`` brings its own. With ``Sq < Sk`` (a KV
    cache) the queries are the last ``Sq`` rows of the mask, or where the mask function placed them
    (a static cache); a caller's 4-D ``attention_mask`` is used as SDPA would use it."""
    if dropout:
        raise ValueError(f"dropout: expected 0.0 (attention dropout is not supported), got {dropout}")
    for name in ("s_aux", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: this model's attention uses {name}, which fm_parallel does not implement; "
                             "use attn_implementation='sdpa' or 'eager' for it")
    for name in ("fm_segment", "fm_sample"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}: expected no preference-row layout in a model forward, got a FlashMaskCollator preference "
                "batch passed whole (a plain Trainer would train next-token loss on both responses, not DPO): train "
                "with fm_parallel.integrations.dpo.FlashMaskDPOTrainer, or pass the model input_ids, position_ids and "
                "flashmask only and score the responses with response_logps(logits, batch)")
    query, key, value = autocast_inputs(query, key, value)
    attention_mask_in = attention_mask
    n_keys = key.shape[2] if fm_context is None else fm_context.plan.num_tokens
    flashmask = _caller_mask(flashmask, fms, fme, n_keys, query.device)
    if attention_mask is not None and attention_mask.dim() == 4:
        if flashmask is not None or fms is not None or fm_context is not None:
            raise ValueError("attention_mask: got a 4-D mask and a FlashMask (or a context); pass one of them")
        # A 4-D mask the caller built: compressed exactly to a FlashMask, or run densely (logged once).
        dense = attention_mask[:, :, :, : key.shape[2]]
        out = flashmask_attention(query, key, value, attn_mask=dense, scale=scaling, impl=fm_impl)
        return out.transpose(1, 2).contiguous(), None
    if flashmask is None:
        if fm_context is not None:  # local positions are a shard's, not a packing: the caller brings the mask
            flashmask = _default_mask(n_keys, bool(getattr(module, "is_causal", True)), query.device)
        else:
            flashmask = _layer_mask(module, query, n_keys, attention_mask, position_ids, cu_seq_lens_q,
                                    cu_seq_lens_k, sliding_window)
            attention_mask = None  # folded in
    elif flashmask.device != query.device and fm_context is None:  # e.g. a collator's CPU mask (the HF Trainer
        # does not move it); a context moves it itself, once per step, and keeps the host copy
        mask_in = flashmask
        flashmask = _MOVED.get((mask_in.fms, mask_in.fme), (query.device,), lambda: mask_in.to(query.device))
    if attention_mask is not None and attention_mask.dim() == 2:
        if fm_context is not None:
            raise ValueError("attention_mask: padding under context parallelism must be in the FlashMask, got a 2-D mask")
        flashmask = _DERIVED_PADDED.get((attention_mask, flashmask.fms, flashmask.fme), (flashmask.num_rows,),
                                         lambda: _with_padding(flashmask, attention_mask))
    if fm_context is None:
        n_queries = query.shape[2]
        offset = getattr(attention_mask_in, "_fm_rows_offset", None)  # where transformers says the queries sit
        if offset is None:  # bottom-right under a (dynamic) cache
            offset = flashmask.num_rows - n_queries if n_queries < flashmask.num_rows else 0
        out = flashmask_attention(query, key, value, mask=flashmask, scale=scaling, impl=fm_impl, q_offset=offset)
    else:
        out = fm_context.attention(query, key, value, flashmask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_DERIVED_PADDED = IdentityCache("HF attention: the mask with the padding folded in", entries=1)
_CHECKED = IdentityCache("HF attention: the caller's fms / fme, validated", entries=1)  # once per forward
_MOVED = IdentityCache("HF attention: the mask moved to the device", entries=1)  # one move per forward, not per
# layer: the kernels' data derived from the moved mask is reused by every layer
