"""Reward-model training in the Hugging Face ``Trainer`` on shared-prompt rows: one prompt and its K
responses packed with a FlashMask (each response sees the prompt and itself), the prompt computed once.

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, attn_implementation=fm_hf.register())
    trainer = FlashMaskRewardTrainer(model=model, args=TrainingArguments(...), train_dataset=pairs)
    trainer = context_parallel(FlashMaskRewardTrainer)(..., cp=ContextParallelConfig(degree=2))   # under CP

Examples (token ids): ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (TRL's pair form) or
``{"prompt_ids", "response_ids": [[...], ...], "scores": [...]}`` (K >= 2 responses ranked by score,
InstructGPT's K-wise form; ties make no pair). Each response's reward is the model's ``score`` head on
its last token: what a sequence classifier reads on prompt + response alone, so the trained model is a
plain ``AutoModelForSequenceClassification``. The loss of a micro-batch is the Bradley-Terry loss
``-log sigmoid(r_better - r_worse)`` averaged over its ranked pairs: TRL's ``RewardTrainer`` loss on
the same pairs unpacked (``tests/integrations/test_reward.py``). Logged as TRL does: ``accuracy``,
``margin``, and the mean ``rewards/chosen`` / ``rewards/rejected`` (``eval_`` prefixed in evaluation).
"""

from __future__ import annotations

import torch

from fm_parallel import logprobs
from fm_parallel.integrations.collator import FlashMaskCollator, response_ends
from fm_parallel.integrations.dpo import _check_attention, check_preference_rows
from fm_parallel.integrations.metrics_trainer import LossMetricsTrainer
from fm_parallel.integrations.text_examples import reward_examples, tokenize_datasets
from fm_parallel.integrations.world import check_trainer_world
from fm_parallel.preference import bradley_terry_loss

__all__ = ["FlashMaskRewardTrainer", "score_head"]

_MODEL_KEYS = ("input_ids", "position_ids", "flashmask")


def score_head(model) -> torch.nn.Module:
    """The scalar head of a sequence classifier with one label (``score``; peft's saved copy when the
    model is a peft model), refusing anything else by name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, "score", None)
    out = getattr(getattr(head, "original_module", head), "out_features", None)
    if head is None or out != 1:
        raise ValueError(f"model: expected a sequence classifier with one label (AutoModelForSequenceClassification."
                         f"from_pretrained(..., num_labels=1): a 'score' head of 1 output), got {type(base).__name__} with "
                         f"{'no score head' if head is None else f'a score head of {out} outputs'}")
    return head


class FlashMaskRewardTrainer(LossMetricsTrainer):
    """A ``transformers.Trainer`` whose loss is the reward model's Bradley-Terry loss on packed
    shared-prompt rows (see the module docstring for the examples).

    Args:
        model: ``AutoModelForSequenceClassification(num_labels=1)`` (or a peft model of one, ``task_type=
            "SEQ_CLS"``: peft then trains the ``score`` head in full beside the adapters), loaded with
            ``attn_implementation=fm_parallel.integrations.transformers.register()``.
        args: ``TrainingArguments``.
        data_collator: default ``FlashMaskCollator(pad_token_id=..., vocab_size=..., preference=True)``, one
            row per batch; ``FlashMaskCollator(seq_len=...)`` packs rows of a fixed length.
        **kwargs: the rest of ``Trainer``'s arguments (``train_dataset``, ``eval_dataset``,
            ``processing_class``, ...). Text datasets in TRL's ``RewardTrainer`` formats (and
            ``{"prompt", "responses", "scores"}``) are tokenized with ``processing_class`` as TRL does
            (:mod:`fm_parallel.integrations.text_examples`).
    """

    loss_is_scaled_for_ga = False  # a mean over this micro-batch's pairs: the Trainer divides by the accumulation steps

    def __init__(self, model=None, args=None, *, data_collator=None, **kwargs):
        if model is None or not isinstance(model, torch.nn.Module):
            raise ValueError(f"model: expected a sequence classifier with one label, got {type(model).__name__}")
        _check_attention(model, "model")
        score_head(model)
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        pad = getattr(config, "pad_token_id", None)
        if not isinstance(pad, int) or pad < 0:
            # The classifier's own pooling needs one for rows of a batch > 1 (its output is not used here).
            config.pad_token_id = pad = 0
        if data_collator is None:
            data_collator = FlashMaskCollator(pad_token_id=pad, vocab_size=getattr(config, "vocab_size", None), preference=True)
        elif isinstance(data_collator, FlashMaskCollator) and not data_collator.preference:
            data_collator = FlashMaskCollator(data_collator.seq_len, data_collator.pad_token_id, data_collator.vocab_size,
                                              preference=True)
        kwargs = tokenize_datasets(kwargs, reward_examples)  # TRL's text records, tokenized as TRL does (processing_class)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        check_trainer_world(self.args)

    def _set_signature_columns_if_needed(self):
        # The model never sees the examples' fields: the collator turns them into rows, so they are kept.
        if self._signature_columns is None:
            self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "response_ids", "scores"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        check_preference_rows(inputs)
        responses = int(inputs["fm_segment"].max())
        ends = response_ends(inputs["fm_segment"], inputs["fm_sample"])
        model_inputs = {k: inputs[k] for k in _MODEL_KEYS}

        def rewards(values):
            return logprobs.response_sums(values, inputs["fm_segment"], inputs["fm_sample"],
                                          samples=int(inputs["fm_sample"].max()) + 1, responses=responses, scored=ends)

        return self.reward_step(model, model_inputs, rewards, inputs, return_outputs)

    def reward_step(self, model, model_inputs: dict, rewards, inputs: dict, return_outputs: bool = False):
        """The Bradley-Terry loss of one micro-batch: the model runs on ``model_inputs`` and ``rewards``
        turns its per-token scalar outputs ``[B, n]`` into the ``[B * most samples, K]`` table of each
        response's reward (a row's samples, then the next row's); the rows' real samples and their
        ranking (``fm_scores``, else chosen over rejected) give the pairs. Records TRL's metrics. The one
        loss of this trainer and of its context-parallel form (which brings its own ``rewards``)."""
        head = score_head(self.accelerator.unwrap_model(model))
        seen = []
        hook = head.register_forward_hook(lambda module, args, out: seen.append(out))
        try:  # through the top module: DDP's gradient hooks and peft's adapters see the call
            outputs = model(**model_inputs, use_cache=False)
        finally:
            hook.remove()
        table = rewards(logprobs.at_least_float32(seen[-1].squeeze(-1)))  # the head on every token [B, n] -> rewards
        keep = logprobs.sample_slots(inputs["fm_sample"]).to(table.device)
        scores = inputs.get("fm_scores")
        losses, metrics = bradley_terry_loss(table[keep], None if scores is None else scores.to(table.device)[keep])
        loss = losses.mean()
        # each rank's mean (data-parallel ranks may hold different numbers of pairs)
        self.record(model, {key: value.float().mean() for key, value in metrics.items()})
        return (loss, outputs) if return_outputs else loss

