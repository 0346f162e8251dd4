"""Checks made before a run creates anything, that need no model: the model folder exists, its
vocabulary holds the tokenizer's ids, and the data file is valid for the objective (one pass, the
first bad record named by ``file:line``). A bad setting then fails in a second, not after the model
is built and the ranks have started.

    preflight(cfg, tokenizer, stop)      # raises ConfigError / DataError naming the key or file:line

A module of its own because it needs both the model's checks and the objectives, and the objectives
need the model (their losses run it): here neither imports the other's caller.
"""

from __future__ import annotations

from pathlib import Path

from fm_parallel.trainer.config import Config, ConfigError, eval_split
from fm_parallel.trainer.model import check_vocabulary
from fm_parallel.trainer.objectives import objective

__all__ = ["preflight"]


def preflight(cfg: Config, tokenizer, stop) -> None:
    """Checks that need no model: folders exist, the data file is valid (one pass, ``file:line`` named).
    ``stop()``: polled during the data pass; a stop request ends it early."""
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: expected a local Hugging Face model folder with a config.json, got {cfg.model.path!r}")
    check_vocabulary(cfg, tokenizer)
    if cfg.data.path:
        objective(cfg).validate(cfg.data.path, tokenizer, stop)
    if cfg.eval.path:  # the held-out file, checked as the training file is, and named by its own key
        objective(cfg).validate(cfg.eval.path, tokenizer, stop, key="eval.path", split=eval_split(cfg))
