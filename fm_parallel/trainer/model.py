"""The trainer's model: the tokenizer, the peft LoRA model (built from the config or loaded from
``model.path``, with tiled layers, activation checkpointing and host offload), and its hidden
states on a batch with FlashMask attention or the SDPA / FlexAttention baselines.

    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg, tokenizer.vocab_size, device)
    h = hidden_states(model, batch)          # [1, n, hidden]: n = this rank's tokens
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from fm_parallel.longcontext import long_context
from fm_parallel.trainer.config import Config, ConfigError, model_dtype
from fm_parallel.trainer.data import load_tokenizer

__all__ = ["tokenizer_source", "build_tokenizer", "check_vocabulary", "compiles", "build_model", "hidden", "hidden_states"]


# What a Hugging Face model folder holds when it carries its own tokenizer (what AutoTokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_source(cfg: Config) -> str:
    """Where the run's tokenizer comes from: ``data.tokenizer`` when given; else ``model.path`` when
    that folder holds its own tokenizer (as ``from_pretrained(path)`` does in Hugging Face); else ""
    (the byte tokenizer)."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.model.path and any((Path(cfg.model.path) / name).is_file() for name in TOKENIZER_FILES):
        return cfg.model.path
    return ""


def build_tokenizer(cfg: Config):
    """The run's tokenizer (:func:`tokenizer_source`). The source is written into ``data.tokenizer``,
    so the run's ``run.json``, a resume's comparison and the exported adapter name the tokenizer the
    run trained with, not "bytes"."""
    given = bool(cfg.data.tokenizer)
    cfg.data.tokenizer = source = tokenizer_source(cfg)
    if given and not Path(source).is_dir():
        raise ConfigError(f"data.tokenizer: expected a local Hugging Face tokenizer folder, got {source!r}")
    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as e:
        key = "data.tokenizer" if given else "model.path"
        raise ConfigError(f"{key}: the tokenizer in {source!r} could not be loaded ({e})"
                          + ("" if given else "; set data.tokenizer to a working tokenizer folder")) from None


def check_vocabulary(cfg: Config, tokenizer) -> None:
    """Refuse a ``model.path`` model whose embedding cannot hold every id the tokenizer gives (an
    index error on every rank otherwise, at the first step). A model built from the config is sized
    to the tokenizer."""
    if not cfg.model.path:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {cfg.model.path!r} holds no readable model config ({e})") from None
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(vocab, int) and vocab < tokenizer.vocab_size:
        which = f"the tokenizer of {cfg.data.tokenizer}" if cfg.data.tokenizer else "the byte tokenizer"
        raise ConfigError(f"model.path: expected a model whose vocabulary holds {which}'s {tokenizer.vocab_size} ids, got "
                          f"vocab_size {vocab} in {cfg.model.path}; set data.tokenizer to the model's own tokenizer "
                          "folder (or use a model trained with this tokenizer)")


def compiles(cfg: Config, device) -> bool:
    """Whether the tiled layers' per-token parts run through ``torch.compile`` (``model.compile``)."""
    return bool(cfg.model.tile_chunk) and (cfg.model.compile == "on" or (cfg.model.compile == "auto"
                                                                         and torch.device(device).type == "cuda"))


class _FactorInInputDtype(torch.nn.Linear):
    """A LoRA factor (``lora_A`` / ``lora_B``) that multiplies in its input's dtype. Its float32 weight
    is cast per call (rank x width elements, nothing next to the N-token product); the gradient reaches
    the float32 weight through the cast, so the optimizer still updates float32 adapters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def lora_in_input_dtype(model) -> int:
    """LoRA products in the base layers' dtype (``model.lora_compute = "base"``); returns the factors
    changed. peft keeps adapters in float32 on a bfloat16 base and copies each layer's input to float32
    before them: at 1M tokens that is a float32 copy of every projection's input and float32 GEMMs
    (no bf16 tensor cores) of [N, hidden] x [hidden, rank]. Here the input stays as it is (peft's own
    ``cast_input_dtype_enabled`` switch) and each factor casts its weight instead: what autocast does,
    scoped to the adapters. The state dict, its names and dtypes are unchanged."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or getattr(module, "lora_variant", None):  # DoRA, ...: peft's own path
            continue
        factors = [f for d in (module.lora_A, module.lora_B) for f in d.values()]
        if not factors or any(type(f) is not torch.nn.Linear for f in factors):  # conv or embedding LoRA: as peft made it
            continue
        module.cast_input_dtype_enabled = False
        for factor in factors:
            factor.__class__ = _FactorInInputDtype
        changed += len(factors)
    return changed


HEADS = ("lm", "score")


def build_model(cfg: Config, vocab_size: int, device, save_base=None, head: str = "lm", reference: bool = False):
    """The peft LoRA model, or with ``model.finetune = "full"`` the whole model sharded by FSDP2 (a
    :class:`~fm_parallel.trainer.fsdp.ShardedModel`; needs the process group). ``save_base(base)``: called with a model built from the config (no
    ``model.path``) before LoRA is injected, so the run can save its random base weights once and
    its adapters load on a fresh copy (rank 0 of a new run: ``export.save_base_model``). ``head``: the
    objective's (``Objective.HEAD``): ``"lm"`` a causal LM; ``"score"`` a sequence classifier with one
    output (``AutoModelForSequenceClassification(num_labels=1)``, a reward model), whose ``score`` head
    peft trains in full beside the adapters (``task_type="SEQ_CLS"``). ``reference``: the objective
    compares with a frozen reference model (DPO); with ``full`` a copy of the initial weights is
    built beside the trained one (:func:`~fm_parallel.trainer.fsdp.reference_model`; LoRA's reference
    is the base with the adapter disabled)."""
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                              LlamaForSequenceClassification)

    from fm_parallel.integrations import transformers as fm_hf

    if head not in HEADS:
        raise ValueError(f"head: expected one of {HEADS}, got {head!r}")
    device = torch.device(device)
    name = {"flashmask": fm_hf.register(), "sdpa": "sdpa", "flex": "flex_attention"}[cfg.model.attention]
    dtype = model_dtype(cfg, device.type == "cuda")
    torch.manual_seed(cfg.training.seed)
    score = {"num_labels": 1} if head == "score" else {}  # one scalar: the reward
    if cfg.model.path:
        auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
        base = auto.from_pretrained(cfg.model.path, attn_implementation=name, dtype=dtype, local_files_only=True, **score)
    else:
        m = cfg.model
        with torch.device(device):  # initialise on the device: an 8B model's CPU init takes minutes
            base = (LlamaForSequenceClassification if head == "score" else LlamaForCausalLM)(LlamaConfig(
                vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                max_position_embeddings=max(cfg.data.seq_len, 2048), attn_implementation=name, **score,
            )).to(dtype)
    base.to(device)
    if save_base is not None and not cfg.model.path and cfg.model.finetune != "full":  # full: the export is the model
        save_base(base)
    # The reference is copied before the components wrap the layers (their wrappers are closures over
    # the original modules, which a deep copy would share). It runs without gradients, where tiles and
    # checkpoints do nothing.
    frozen = copy.deepcopy(base) if reference and cfg.model.finetune == "full" else None
    m = cfg.model
    if not m.activation_checkpointing and m.offload_layers:
        raise ConfigError(f"model.offload_layers: expected 0 without activation checkpointing, got {m.offload_layers}")
    try:  # the components any HF model can take (fm_parallel.longcontext), with the run's keys
        policy = long_context(base, tile_chunk=m.tile_chunk, attention_chunk=m.attention_chunk,
                              checkpoint_every=m.checkpoint_every if m.activation_checkpointing else 1,
                              offload_layers=m.offload_layers, compile=compiles(cfg, device),
                              checkpointing=m.activation_checkpointing)
    except ValueError as e:  # against the built model's layers (a model.path model's are known only now)
        key, _, rest = str(e).partition(": ")
        key = {"every": "checkpoint_every", "model": "path"}.get(key, key)
        raise ConfigError(f"model.{key}: {rest}") from None
    if cfg.model.finetune == "full":  # every weight, sharded over the world (fm_parallel/trainer/fsdp.py)
        from fm_parallel.trainer.fsdp import shard_full_model

        model = shard_full_model(base, cfg, device, reference=frozen, every=policy.every if policy is not None else 1)
        model.train()
        model.checkpoint_policy = policy
        return model
    lora = LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha, lora_dropout=cfg.model.lora_dropout,
                      target_modules=[t.strip() for t in cfg.model.lora_targets.split(",") if t.strip()],
                      **({"task_type": "SEQ_CLS"} if head == "score" else {}))
    model = get_peft_model(base, lora)
    if cfg.model.lora_compute == "base":
        lora_in_input_dtype(model)
    model.train()
    model.checkpoint_policy = policy
    return model


def hidden(model, ids, positions, mask, ctx, impl: str) -> torch.Tensor:
    """The decoder's last hidden states ``[1, n, hidden]`` for ``ids [1, n]``. ``mask``: the row's
    FlashMask, or under CP (``ctx`` given) its PreparedMask; ``impl``: the kernel without CP."""
    base = model.get_base_model()
    attention = base.config._attn_implementation
    if attention == "sdpa":  # the dense baseline: an N x N boolean mask, as a user without FlashMask would build
        return base.model(input_ids=ids, position_ids=positions, attention_mask=mask.to_dense()).last_hidden_state
    if attention == "flex_attention":  # the FlexAttention baseline: a BlockMask made from the same mask
        from fm_parallel.masks import to_block_mask

        block = to_block_mask(mask, _compile=ids.device.type == "cuda")
        return base.model(input_ids=ids, position_ids=positions, attention_mask=block).last_hidden_state
    kernel = {"fm_context": ctx} if ctx is not None else {"fm_impl": impl}  # under CP the context picks it
    return base.model(input_ids=ids, position_ids=positions, flashmask=mask, **kernel).last_hidden_state


def hidden_states(model, batch) -> torch.Tensor:
    """:func:`hidden` on a :class:`~fm_parallel.trainer.parallel.Batch`."""
    return hidden(model, batch.ids, batch.positions, batch.mask, batch.ctx, batch.impl)
