"""The part of our preference trainers (``FlashMaskDPOTrainer``, ``FlashMaskRewardTrainer``) that is not
their loss: evaluation of the loss alone, and per-step metrics logged as TRL logs them.

    class MyTrainer(LossMetricsTrainer):
        def compute_loss(self, model, inputs, ...):
            ...; self.record(model, {"accuracy": per_pair}); return loss
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import Trainer

__all__ = ["LossMetricsTrainer"]


class LossMetricsTrainer(Trainer):
    """A ``transformers.Trainer`` whose ``compute_loss`` records metrics with :meth:`record`; each log
    carries their means since the last one (``eval_`` prefixed in evaluation), as TRL's trainers do.
    Evaluation gives the loss only: the rows are packed preference samples, which the Trainer's default
    prediction step would run through the plain forward (refused by the attention backend)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def record(self, model, metrics: dict[str, torch.Tensor]) -> None:
        """Keep each metric of this micro-batch: its values gathered from every rank, then their mean
        (pass per-sample tensors of one length on every rank, or each rank's mean as a scalar)."""
        mode = "train" if model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value).float().mean().item())

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(v) / len(v) for key, v in self._metrics[mode].items() if v}
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()
