"""Long-context components for any Hugging Face causal LM on our attention, and the trainer's.

    from fm_parallel.longcontext import long_context

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=fm_hf.register())
    policy = long_context(model, tile_chunk=16384, checkpoint_every=2, offload_layers=-1, loss_chunk=1024)
    model = get_peft_model(model, lora)          # before or after: the layers look their modules up per call
    Trainer(model=model, args=TrainingArguments(..., gradient_checkpointing=False), ...)   # ours replaces HF's

* :mod:`.tiling`: tiled decoder layers, each its own activation checkpoint (it keeps its input only),
  FlashMask attention over query chunks, per-token parts (norms, rotary, MLP, LoRA) over tiles and
  optionally compiled;
* :mod:`.memory`: per-layer checkpoints, every ``k`` layers, inputs offloaded to pinned host memory on
  a side stream (:class:`~.memory.CheckpointPolicy`), and the memory plan's arithmetic;
* :mod:`.loss`: the chunked next-token loss (full-vocabulary logits never exist at once), also inside
  an HF model's own forward (``loss_chunk``);
* :mod:`.tiles`: the tiled map / sum the layers and the loss are made of;
* :mod:`.plan`: the memory plan for a length and stated device / host memory (:func:`plan_long_context`,
  from a budget :func:`measure_budget` reads on the GPU);
* :mod:`.memory_breakdown`: where a step's memory goes.

Nothing here reads the trainer's configuration: the trainer (``fm_parallel/trainer/model.py``) calls
:func:`long_context` with its ``model.*`` keys, as an HF user does with arguments.
"""

from __future__ import annotations

import torch

from fm_parallel.longcontext.loss import check_chunked_lm_loss, chunked_lm_loss
from fm_parallel.longcontext.memory import CheckpointPolicy, MemoryPlan, MemoryPlanError, StepBudget, checkpoint_layers
from fm_parallel.longcontext.plan import measure_budget, plan_long_context, static_bytes
from fm_parallel.longcontext.tiling import tile_decoder_layers, untile_decoder_layers

__all__ = ["long_context", "CheckpointPolicy", "measure_budget", "plan_long_context", "static_bytes", "MemoryPlan",
           "MemoryPlanError", "StepBudget"]


def _hf_model(model):
    """The Hugging Face model inside a peft wrapper (or ``model``)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check(model, tile_chunk: int) -> None:
    """Refuse what tiled layers cannot do: layers that are not full attention, dropout."""
    if not tile_chunk:
        return
    config = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        raise ValueError(f"tile_chunk: expected full-attention layers only (a tiled layer attends by the mask it is "
                         f"given, not a layer's own window), got layer types {sorted(kinds)}; apply long_context with "
                         "tile_chunk=0 (checkpointing and offload only)")
    dropouts = sorted({f"{type(m).__name__}(p={m.p})" for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    if getattr(config, "attention_dropout", 0.0) or dropouts:
        raise ValueError(f"tile_chunk: expected no dropout in the model (a tiled layer recomputes its tiles in the "
                         f"backward without the forward's dropout masks), got {dropouts or 'attention_dropout > 0'}; "
                         "set the dropouts to 0 or tile_chunk=0")


def long_context(model, *, tile_chunk: int = 0, attention_chunk: int = 65536, checkpoint_every: int = 1,
                 offload_layers: int = 0, compile: bool = False, checkpointing: bool = True,
                 loss_chunk: int = 0) -> CheckpointPolicy | None:
    """Apply the long-context components to ``model`` (a Hugging Face causal LM or sequence
    classifier, or its peft wrapper), in place; returns the checkpoint policy (None without
    ``checkpointing``), whose ``host_bytes`` says what offload holds.

    Args:
        tile_chunk: > 0: every decoder layer becomes a tiled layer over tiles of this many tokens (its
            own checkpoint; FlashMask attention per query chunk on our attention, the model's own
            attention in one call on any other); no dropout. 0: layers as they are.
        attention_chunk: a tiled layer's FlashMask attention over query chunks of at most this many
            rows, cut between documents where possible (0: one call).
        checkpoint_every: layers per activation checkpoint (k > 1 recomputes k layers from one input).
        offload_layers: layers (from the first) whose checkpointed inputs live in pinned host memory
            (-1: all).
        compile: the tiled layers' per-token parts through ``torch.compile`` (a GPU with a compiler).
        checkpointing: False: no activation checkpoints (then ``offload_layers`` must be 0).
        loss_chunk: > 0: a causal LM's forward with ``labels`` computes HF's loss over chunks of this
            many tokens and returns no logits (:func:`~fm_parallel.longcontext.loss.chunked_lm_loss`);
            at 256k tokens and a 128k vocabulary the logits alone would be 64 GiB in bfloat16. TRL's
            trainers use their own fused head, which runs through the same tiled layers. 0: the
            model's own loss.

    Applied again (another plan, other chunks), the new settings replace the old ones. The model's
    ``config.use_cache`` is turned off (training). Use it instead of HF's
    ``gradient_checkpointing``, not with it. Raises ``ValueError`` naming the argument for what the
    components cannot do (sliding-window layers or dropout with tiles, a model without decoder layers,
    a chunked loss on a model without an LM head or with logit softcapping)."""
    for name, value, low in (("tile_chunk", tile_chunk, 0), ("attention_chunk", attention_chunk, 0),
                             ("checkpoint_every", checkpoint_every, 1), ("loss_chunk", loss_chunk, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if isinstance(offload_layers, bool) or not isinstance(offload_layers, int) or offload_layers < -1:
        raise ValueError(f"offload_layers: expected -1 (all) or an int >= 0, got {offload_layers!r}")
    if not checkpointing and (offload_layers or checkpoint_every != 1):
        raise ValueError(f"checkpointing: expected True with offload_layers {offload_layers} and checkpoint_every "
                         f"{checkpoint_every} (both place checkpoints), got False")
    base = _hf_model(model)
    _check(base, tile_chunk)
    if loss_chunk:  # before any change: a model refused is left as it was
        check_chunked_lm_loss(base, loss_chunk)
    if getattr(base, "config", None) is not None:
        base.config.use_cache = False
    if tile_chunk:  # before checkpoint_layers, which then leaves the tiled layers (their own checkpoints) unwrapped
        tile_decoder_layers(base, tile_chunk, attention_chunk, compiled=compile)
    else:  # applied again without tiles: the layers as they were
        untile_decoder_layers(base)
    policy = checkpoint_layers(base, offload_layers, checkpoint_every) if checkpointing else None
    if loss_chunk:
        chunked_lm_loss(base, loss_chunk)
    return policy
