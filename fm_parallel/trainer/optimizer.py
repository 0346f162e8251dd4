"""The update: AdamW on the trained parameters, the learning-rate schedule (``transformers.get_scheduler``'s,
evaluated per step so that a resumed run needs no scheduler state), and one optimizer step on gradients
summed over the whole world.

    params, optim = build_optimizer(model, cfg)
    set_learning_rate(optim, cfg, step); ...backward...; update(params, optim)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from fm_parallel.trainer.config import Config

__all__ = ["build_optimizer", "learning_rate", "set_learning_rate", "update", "SCHEDULE_KEYS"]

# The keys that decide learning_rate(cfg, step) for every step: a resumed run continues the schedule
# only when they are the checkpoint's.
SCHEDULE_KEYS = ("training.steps", "training.warmup", "training.lr", "training.scheduler")


def build_optimizer(model, cfg: Config):
    """``(params, optim)``: the trainable parameters (LoRA's, or every weight's shard) and their AdamW.
    ``training.weight_decay`` applies to matrices only: biases and norm weights (one dimension) never
    decay, as in HF Trainer."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.training.weight_decay}] + ([{"params": rest, "weight_decay": 0.0}] if rest else [])
    return params, torch.optim.AdamW(groups, lr=cfg.training.lr)


@functools.lru_cache(maxsize=8)
def _multiplier(scheduler: str, warmup: int, steps: int):
    """``step -> factor`` of ``transformers.get_scheduler(scheduler)`` over ``steps`` with ``warmup``."""
    from transformers import get_scheduler

    name, extra = {"constant": ("constant_with_warmup", {}),
                   "cosine_with_min_lr": ("cosine_with_min_lr", {"min_lr_rate": 0.1})}.get(scheduler, (scheduler, {}))
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_scheduler(name, probe, num_warmup_steps=warmup, num_training_steps=steps,
                         scheduler_specific_kwargs=extra).lr_lambdas[0]


def learning_rate(cfg: Config, step: int) -> float:
    """The learning rate of optimizer step ``step`` (from 0): ``training.lr`` times
    ``transformers.get_scheduler(training.scheduler)``'s factor, linear warm-up from 0 over
    ``training.warmup`` steps (HF Trainer's schedules, step for step)."""
    t = cfg.training
    return t.lr * _multiplier(t.scheduler, t.warmup, t.steps)(step)


def set_learning_rate(optim, cfg: Config, step: int) -> float:
    lr = learning_rate(cfg, step)
    for group in optim.param_groups:
        group["lr"] = lr
    return lr


def update(params, optim, max_norm: float = 1.0) -> float:
    """Sum the gradients over the world (losses were normalised globally, so the sum is the one-process
    gradient), clip to ``max_norm`` (0: no clipping), step, and clear them; returns the gradient norm
    before clipping.
    Sharded parameters (FSDP2's ``DTensor`` s, ``model.finetune = "full"``) arrive summed already
    (their reduce-scatter in the backward); their norm is the whole model's."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor):
            continue
        if p.grad is None:  # a rank whose rows reached no adapter still takes part in the sum
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return norm.item()
