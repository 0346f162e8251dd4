"""DPO with a shared prompt in the Hugging Face ``Trainer``: each pair is packed as one prompt followed
by both responses under the FlashMask ``preference`` mask (the prompt computed once, not once per
response as in TRL's layout), and trained with the sigmoid DPO loss.

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, attn_implementation=fm_hf.register()), lora)
    trainer = FlashMaskDPOTrainer(model=model, args=TrainingArguments(...), beta=0.1,
                                  train_dataset=[{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r}, ...])
    trainer.train()     # logs loss and TRL's DPO metrics: rewards/chosen, rewards/rejected, rewards/margins,
                        # rewards/accuracies, logps/chosen, logps/rejected

The reference is the peft model with its adapter disabled, or ``ref_model=`` (a frozen model, also on
the ``fm_parallel`` attention). A response's first token is not scored (the prompt's last position is
shared by both responses): text datasets (``processing_class``) open each response with the prompt's last
token, so the losses are TRL's ``DPOTrainer``'s on the same records; token ids can do the same.
"""

from __future__ import annotations

import math

import torch

from fm_parallel.integrations import transformers as fm_hf
from fm_parallel.integrations.collator import FlashMaskCollator, response_logps
from fm_parallel.integrations.metrics_trainer import LossMetricsTrainer
from fm_parallel.integrations.text_examples import dpo_examples, tokenize_datasets
from fm_parallel.integrations.world import check_trainer_world
from fm_parallel.preference import dpo_loss  # written in preference.py, for both front doors; still exported here

__all__ = ["FlashMaskDPOTrainer", "dpo_loss"]

_MODEL_KEYS = ("input_ids", "position_ids", "flashmask")


def _check_attention(model, name: str) -> None:
    """Refuse a model whose attention is not ours: every other implementation ignores the ``flashmask``
    keyword, so both responses would see each other (and the next pair) without an error."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    impl = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if impl is None or ALL_ATTENTION_FUNCTIONS.get(impl) is not fm_hf.attention_forward:
        raise ValueError(f"{name}: expected a model loaded with attn_implementation=fm_parallel.integrations.transformers."
                         f"register() (the only attention that reads the preference mask), got attn_implementation {impl!r}")


def check_preference_rows(inputs) -> None:
    """Refuse a batch that is not FlashMaskCollator preference rows, naming the keys it has."""
    if not isinstance(inputs, dict) or "fm_segment" not in inputs:
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(f"inputs: expected FlashMaskCollator preference rows (fm_segment, fm_sample) from examples "
                         f"{{prompt_ids, chosen_ids, rejected_ids}}, got keys {got}")


class FlashMaskDPOTrainer(LossMetricsTrainer):
    """A ``transformers.Trainer`` whose loss is shared-prompt DPO.

    Args:
        model: the policy: a peft model (the reference is it with the adapter disabled) or, with
            ``ref_model``, any causal LM; loaded with ``attn_implementation=fm_hf.register()``.
        args: ``TrainingArguments``; ``remove_unused_columns`` may stay True (the example fields are kept).
        ref_model: the frozen reference model (same attention), or None (peft: adapter disabled).
        beta: the DPO temperature, > 0.
        data_collator: default ``FlashMaskCollator(vocab_size=model.config.vocab_size, preference=True)``,
            one row per batch; pass ``FlashMaskCollator(seq_len=...)`` to pack into rows of a fixed length
            (used with ``preference=True``).
        **kwargs: the rest of ``Trainer``'s arguments (``train_dataset``, ``eval_dataset``,
            ``processing_class``, ...).
    Examples: TRL's ``DPOTrainer`` records (``{"prompt", "chosen", "rejected"}`` as strings or
    conversations, or ``{"chosen", "rejected"}``), tokenized with ``processing_class`` as TRL tokenizes
    them (:mod:`fm_parallel.integrations.text_examples`: the losses are TRL's); or token ids
    ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (or ``response_ids`` with two responses). The
    loss of a step is the mean over its pairs, as TRL's.
    """

    loss_is_scaled_for_ga = False  # a mean over this micro-batch's pairs: the Trainer divides by the accumulation steps

    def __init__(self, model=None, args=None, *, ref_model=None, beta: float = 0.1, data_collator=None, **kwargs):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
            raise ValueError(f"beta: expected a finite float > 0, got {beta!r}")
        if model is None or not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: expected a causal LM (a peft model, or any with ref_model=), got {type(model).__name__}")
        _check_attention(model, "model")
        if ref_model is None:
            if not hasattr(model, "disable_adapter"):
                raise ValueError(f"ref_model: expected a reference model, or a peft model whose adapter disabled is the "
                                 f"reference, got ref_model=None and a {type(model).__name__}")
        else:
            _check_attention(ref_model, "ref_model")
        if data_collator is None:
            config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
            pad = getattr(config, "pad_token_id", None)
            data_collator = FlashMaskCollator(pad_token_id=pad if isinstance(pad, int) and pad >= 0 else 0,
                                              vocab_size=getattr(config, "vocab_size", None), preference=True)
        elif isinstance(data_collator, FlashMaskCollator) and not data_collator.preference:
            # The user's packing settings, for the rows this trainer exists for (a copy: theirs is left as given).
            data_collator = FlashMaskCollator(data_collator.seq_len, data_collator.pad_token_id, data_collator.vocab_size,
                                              preference=True)
        kwargs = tokenize_datasets(kwargs, dpo_examples)  # TRL's text records, tokenized as TRL does (processing_class)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        check_trainer_world(self.args)  # every launched rank trains one model, or the Trainer refuses
        self.beta = float(beta)
        self.ref_model = None
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)

    def _set_signature_columns_if_needed(self):
        # The model never sees the examples' fields: the collator turns them into rows, so they are kept.
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "response_ids"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        check_preference_rows(inputs)
        model_inputs = {k: inputs[k] for k in _MODEL_KEYS}
        return self.dpo_step(model, model_inputs, lambda logits: response_logps(logits, inputs, responses=2), return_outputs)

    def dpo_step(self, model, model_inputs: dict, logps, return_outputs: bool = False):
        """The DPO loss of one micro-batch: ``logps(logits)`` gives the ``[pairs, 2]`` response sums of
        the policy's and then the reference's logits on ``model_inputs``; records TRL's metrics. The one
        loss of this trainer and of its context-parallel form (which brings its own ``logps``)."""
        outputs = model(**model_inputs, use_cache=False)
        policy = logps(outputs.logits)
        with torch.no_grad():
            if self.ref_model is not None:
                ref_logits = self.ref_model(**model_inputs, use_cache=False).logits
            else:
                unwrapped = self.accelerator.unwrap_model(model)
                with unwrapped.disable_adapter():
                    ref_logits = unwrapped(**model_inputs, use_cache=False).logits
            reference = logps(ref_logits)
        losses, metrics = dpo_loss(policy, reference, self.beta)
        loss = losses.mean()
        self.record(model, metrics)
        return (loss, outputs) if return_outputs else loss
