"""The update: AdamW on the LoRA parameters, the learning-rate schedule, and one optimizer step on
gradients summed over the whole world.

    params, optim = build_optimizer(model, cfg)
    set_learning_rate(optim, cfg, step); ...backward...; update(params, optim)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fm_parallel.trainer.config import Config

__all__ = ["build_optimizer", "learning_rate", "set_learning_rate", "update", "SCHEDULE_KEYS"]

# The keys that decide learning_rate(cfg, step) for every step: a resumed run continues the schedule
# only when they are the checkpoint's.
SCHEDULE_KEYS = ("training.steps", "training.warmup", "training.lr")


def build_optimizer(model, cfg: Config):
    """``(params, optim)``: the trainable parameters (LoRA's, or every weight's shard) and their AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    return params, torch.optim.AdamW(params, lr=cfg.training.lr, weight_decay=0.0)


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warm-up to ``training.lr``, then cosine down to a tenth of it at ``training.steps``."""
    t = cfg.training
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    progress = (step - t.warmup) / max(t.steps - t.warmup, 1)
    return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def set_learning_rate(optim, cfg: Config, step: int) -> float:
    lr = learning_rate(cfg, step)
    for group in optim.param_groups:
        group["lr"] = lr
    return lr


def update(params, optim) -> float:
    """Sum the gradients over the world (losses were normalised globally, so the sum is the one-process
    gradient), clip to norm 1, step, and clear them; returns the gradient norm before clipping.
    Sharded parameters (FSDP2's ``DTensor`` s, ``model.finetune = "full"``) arrive summed already
    (their reduce-scatter in the backward); their norm is the whole model's."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor):
            continue
        if p.grad is None:  # a rank whose rows reached no adapter still takes part in the sum
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return norm.item()
