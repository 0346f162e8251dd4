"""Trainer configuration: one TOML file, then environment, then command-line overrides (torchtitan style).

    torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml --training.steps 20
    FM_TRAINING__STEPS=20 torchrun ... launch/train.py            # section and key joined by "__"

Every field has a default, so an empty config trains the small CPU model on the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["Config", "load_config"]


@dataclass
class ModelConfig:
    path: str = ""  # a local Hugging Face model folder; empty: a small Llama built from the fields below
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 688
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"
    activation_checkpointing: bool = True
    offload_layers: int = 0  # layers (from the first) whose checkpointed input lives in host memory; -1: all
    attention: str = "flashmask"  # flashmask | sdpa (dense N x N mask) | flex (BlockMask): the baselines need cp 1
    tile_chunk: int = 0  # run each layer's per-token work (norms, projections, rotary, MLP) over chunks of this many tokens (0: off)


@dataclass
class DataConfig:
    objective: str = "sft"  # sft | dpo
    path: str = ""  # JSONL ({"text"} for SFT, {"prompt","chosen","rejected"} for DPO); empty: the stdlib corpus
    tokenizer: str = ""  # a local HF tokenizer folder; empty: bytes
    seq_len: int = 2048


@dataclass
class TrainingConfig:
    steps: int = 30
    lr: float = 1e-3
    warmup: int = 3
    seed: int = 0
    grad_accum: int = 1
    loss_chunk: int = 1024  # tokens per chunk of the chunked loss (full-vocabulary logits never exist at once)
    dpo_beta: float = 0.1


@dataclass
class ParallelConfig:
    cp: str = "ring"  # ring | ulysses | hybrid | none
    cp_degree: int = -1  # -1: every rank (no data parallelism)
    ulysses_degree: int = 1  # the Ulysses part of hybrid
    balance: str = "zigzag"  # contiguous | zigzag | mask
    impl: str = ""  # attention kernel (cute | triton | torch), with or without CP; empty: automatic


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    checkpoint_every: int = 10
    log_every: int = 1
    resume: bool = False
    stop_after: int = -1  # stop with a checkpoint after this many steps (time-limited jobs); -1: run to the end


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(section: str, key: str, value, target):
    kind = type(target)
    if kind is bool and isinstance(value, str):
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"{section}.{key}: expected a boolean, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{section}.{key}: expected {kind.__name__}, got {value!r}") from None


def _apply(cfg: Config, section: str, key: str, value, source: str) -> None:
    if not hasattr(cfg, section) or section.startswith("_"):
        raise ValueError(f"{source}: unknown section {section!r}; expected one of {[f.name for f in dataclasses.fields(cfg)]}")
    sub = getattr(cfg, section)
    if not hasattr(sub, key):
        raise ValueError(f"{source}: unknown key {section}.{key}; expected one of {[f.name for f in dataclasses.fields(sub)]}")
    setattr(sub, key, _coerce(section, key, value, getattr(sub, key)))


def load_config(argv: list[str] | None = None, environ: dict | None = None) -> Config:
    """Defaults, then ``--config FILE`` (TOML), then ``FM_SECTION__KEY`` variables, then ``--section.key value``."""
    parser = argparse.ArgumentParser(description="fm_parallel trainer", allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output.dir")
    args, rest = parser.parse_known_args(argv)
    cfg = Config()
    if args.config is not None:
        if not args.config.exists():
            raise ValueError(f"--config: expected an existing TOML file, got {args.config}")
        with open(args.config, "rb") as f:
            for section, values in tomllib.load(f).items():
                if not isinstance(values, dict):
                    raise ValueError(f"{args.config}: expected [section] tables, got a top-level {section!r}")
                for key, value in values.items():
                    _apply(cfg, section, key, value, str(args.config))
    for name, value in (os.environ if environ is None else environ).items():
        if name.startswith("FM_") and "__" in name:
            section, key = name[3:].lower().split("__", 1)
            _apply(cfg, section, key, value, f"environment {name}")
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or "." not in token:
            raise ValueError(f"command line: expected --section.key VALUE, got {token!r}")
        name, _, inline = token[2:].partition("=")
        if inline == "" and "=" not in token:
            if i + 1 >= len(rest):
                raise ValueError(f"command line: expected a value after {token}")
            inline, i = rest[i + 1], i + 1
        section, key = name.split(".", 1)
        _apply(cfg, section, key, inline, "command line")
        i += 1
    if args.resume:
        cfg.output.resume = True
    if cfg.data.objective not in ("sft", "dpo"):
        raise ValueError(f"data.objective: expected 'sft' or 'dpo', got {cfg.data.objective!r}")
    if cfg.model.attention not in ("flashmask", "sdpa", "flex"):
        raise ValueError(f"model.attention: expected flashmask, sdpa or flex, got {cfg.model.attention!r}")
    if cfg.parallel.cp not in ("ring", "ulysses", "hybrid", "none"):
        raise ValueError(f"parallel.cp: expected ring, ulysses, hybrid or none, got {cfg.parallel.cp!r}")
    if cfg.parallel.impl not in ("", "auto", "cute", "triton", "torch"):
        raise ValueError(f"parallel.impl: expected cute, triton, torch or empty (automatic), got {cfg.parallel.impl!r}")
    return cfg
