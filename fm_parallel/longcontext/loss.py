"""The chunked next-token loss: full-vocabulary logits never exist at once (at 256k tokens and a
128k vocabulary they would be 64 GiB in bfloat16, 128 in float32), for the trainer's objectives and,
through :func:`chunked_lm_loss`, inside any Hugging Face causal LM's own forward.

    loss = chunked_cross_entropy(model.lm_head, hidden, labels, 1024)   # summed over [B, n] targets

    chunked_lm_loss(model, 1024)          # model(..., labels=...) now returns the loss and no logits
    Trainer(model=model, ...)             # HF's loss, num_items_in_batch and all, as the model's own

Each chunk's logits are recomputed in the backward instead of kept
(:func:`~fm_parallel.longcontext.tiles.tiled_sum`): what the loss keeps is the decoder's final hidden
state ``[B, n, hidden]``.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from fm_parallel.logprobs import at_least_float32
from fm_parallel.longcontext.tiles import tiled_sum

__all__ = ["chunked", "chunked_cross_entropy", "chunked_lm_loss", "check_chunked_lm_loss", "has_chunked_loss"]

# Config fields that change the logits after the head (softcapping, scales): a chunked loss that left
# them out would train on other logits than the model's, so a model that sets one is refused.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def chunked(head, hidden, labels, chunk: int, fn):
    """Sum of ``fn(logits_chunk, labels_chunk)`` over token chunks of ``hidden [B, n, hidden]`` and
    ``labels [B, n]``; each chunk's logits (at least float32) are recomputed in the backward instead
    of kept, so ``[n, vocab]`` logits never exist at once, and ``hidden``'s gradient is written chunk by
    chunk into one buffer."""
    return tiled_sum(lambda h_, y_: fn(at_least_float32(head(h_)), y_), hidden, chunk, labels, params=head.parameters())


def chunked_cross_entropy(head, hidden, labels, chunk: int):
    """The summed next-token cross-entropy of ``hidden [B, n, hidden]`` against ``labels [B, n]`` (-100:
    not scored; already shifted: ``labels[:, i]`` is the token after position ``i``), over
    :func:`chunked` logits."""
    return chunked(head, hidden, labels, chunk,
                   lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))


def has_chunked_loss(model) -> bool:
    """Whether :func:`chunked_lm_loss` was applied to ``model`` (a Hugging Face model or its peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_fm_loss_chunk", 0) > 0


def check_chunked_lm_loss(model, chunk: int) -> None:
    """Raise what :func:`chunked_lm_loss` would refuse, changing nothing."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"loss_chunk: expected an int >= 1, got {chunk!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", None)
    if head is None or backbone is None or backbone is model:
        raise ValueError(f"loss_chunk: expected a causal LM with an output head (AutoModelForCausalLM's), got "
                         f"{type(model).__name__}; use loss_chunk=0 for other models")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    transforms = {k: getattr(config, k) for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1.0)}
    if transforms:
        raise ValueError(f"loss_chunk: expected a model whose logits are its head's output, got {type(model).__name__} "
                         f"with {transforms}; use loss_chunk=0 (the model's own loss)")
    if getattr(config, "output_router_logits", False):
        raise ValueError(f"loss_chunk: expected a model without a router's auxiliary loss in its own, got "
                         f"{type(model).__name__} with output_router_logits=True; use loss_chunk=0 (the model's own loss)")


def chunked_lm_loss(model, chunk: int) -> None:
    """Make ``model`` (a Hugging Face causal LM, not its peft wrapper) compute its loss over chunks of
    ``chunk`` tokens, in place: ``model(..., labels=[B, n])`` (with ``shift_labels``, already shifted, as
    HF passes under context parallelism, scored instead) returns ``CausalLMOutputWithPast(loss=...)``
    with no logits;
    the loss is HF's (``ForCausalLMLoss``: the sum over targets divided by ``num_items_in_batch`` when
    given, else their mean). Without labels the forward is the model's own (generation, TRL's fused
    head, evaluation of logits). Raises ``ValueError`` for a model whose logits are transformed after
    its head (softcapping, scales) or that has no output embeddings."""
    check_chunked_lm_loss(model, chunk)
    if getattr(model, "_fm_loss_chunk", 0):  # applied again: the new chunk, one wrapper
        model._fm_loss_chunk = chunk
        return
    original = model.forward
    model._fm_loss_chunk = chunk

    # The class's signature is kept (``generate`` and HF Trainer's loss-kwargs check read it).
    @functools.wraps(type(model).forward)
    def forward(self, *args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if labels is None:  # as HF's forward: no loss without labels (shift_labels only replace their shift)
            extra = {k: v for k, v in (("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch))
                     if v is not None}
            return original(*args, **kwargs, **extra)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if kwargs.get("output_router_logits"):  # HF adds the router's auxiliary loss to its own: not here
            raise ValueError("output_router_logits: expected False with long_context(loss_chunk=...) (the chunked loss "
                             "has no router auxiliary loss), got True")
        kwargs.pop("logits_to_keep", None)  # the loss needs every position's hidden state
        ignore = kwargs.pop("ignore_index", -100)
        out = self.base_model(*args, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore)[..., 1:]  # HF's shift: position i predicts i + 1
        targets = shift_labels.to(hidden.device)
        if ignore != -100:  # HF's ignore_index: the chunked loss skips -100 (no token id is negative)
            targets = targets.masked_fill(targets == ignore, -100)
        total = chunked_cross_entropy(self.get_output_embeddings(), hidden, targets, self._fm_loss_chunk)
        if num_items_in_batch is not None:
            loss = total / (num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        else:  # HF's mean over the targets (NaN without any, as F.cross_entropy's mean)
            loss = total / (targets != -100).sum()
        return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(out, "hidden_states", None),
                                      attentions=getattr(out, "attentions", None))

    model.forward = types.MethodType(forward, model)
