"""Trainer configuration: one TOML file, then environment, then command-line overrides (torchtitan style).

    torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml --training.steps 20
    FM_TRAINING__STEPS=20 torchrun ... launch/train.py            # section and key joined by "__"
    python launch/train.py --help                                 # every key, its default and meaning

Every field has a default, so an empty config trains the small CPU model on the standard library.
Every key is checked when the config is loaded: its type (TOML ``steps = 2.7`` or ``true`` is refused,
never rounded or cast), its range or its choices, and the rules between keys; a bad value raises
:class:`ConfigError` (a ``ValueError``) naming the key, what it expects and what it got.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fm_parallel import backends
from fm_parallel.trainer.data import DPO_LAYOUTS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

__all__ = ["Config", "ConfigError", "load_config", "describe", "check_before_start", "check_host_memory", "model_dtype",
           "eval_split"]


class ConfigError(ValueError):
    """A configuration, data or run-directory error made by the user: reported in one line, no traceback."""


def _key(default, help: str, *, choices: tuple | None = None, low=None, high=None, low_open: bool = False,
         special: tuple = (), choices_text: str | None = None):
    """A config key: its default, its meaning for ``--help``, and what values it accepts.

    ``low`` / ``high``: inclusive range (``low_open``: strictly above ``low``); ``special``: values
    accepted outside the range (``-1`` meaning "all" or "never")."""
    return field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high,
                                            "low_open": low_open, "special": special, "choices_text": choices_text})


@dataclass
class ModelConfig:
    path: str = _key("", "a local Hugging Face model folder; empty: a small Llama built from the fields below")
    hidden_size: int = _key(256, "width of the built Llama (a multiple of heads)", low=1)
    layers: int = _key(4, "decoder layers of the built Llama", low=1)
    heads: int = _key(4, "query heads of the built Llama", low=1)
    kv_heads: int = _key(2, "key/value heads of the built Llama (divides heads)", low=1)
    intermediate_size: int = _key(688, "MLP width of the built Llama", low=1)
    dtype: str = _key("auto", "parameter dtype; auto: bfloat16 on GPU, float32 on CPU; finetune full: float32 "
                              "master weights (bfloat16 compute on a GPU)",
                      choices=("auto", "float32", "bfloat16", "float64"))
    finetune: str = _key("lora", "lora (peft adapters on a frozen base) | full (every weight trained, sharded with "
                                 "FSDP2 over every rank, data and context parallel)", choices=("lora", "full"))
    offload_optimizer: bool = _key(False, "finetune full: parameters, gradients and AdamW state in host memory (FSDP2's "
                                          "CPUOffloadPolicy; the optimizer steps on the CPU)")
    lora_rank: int = _key(16, "LoRA rank", low=1)
    lora_alpha: int = _key(32, "LoRA alpha (scale = alpha / rank)", low=1)
    lora_dropout: float = _key(0.0, "dropout on the LoRA adapters' input (peft's lora_dropout); not with model.tile_chunk "
                                    "(a tiled layer is recomputed tile by tile)", low=0.0, high=0.99)
    lora_targets: str = _key("q_proj,k_proj,v_proj,o_proj", "comma-separated module names that get LoRA adapters")
    lora_compute: str = _key("base", "dtype of the LoRA products: base (the base weights' dtype, bfloat16 on a GPU; the "
                                     "adapters, their gradients and optimizer state stay float32) | float32 (peft's "
                                     "default: each layer input copied to float32 first)", choices=("base", "float32"))
    activation_checkpointing: bool = _key(True, "recompute each decoder layer in the backward")
    offload_layers: int = _key(0, "layers (from the first) whose checkpointed input lives in host memory; -1: all",
                               low=0, special=(-1,))
    checkpoint_every: int = _key(1, "layers per activation checkpoint; k > 1 keeps every k-th layer's input only and "
                                    "recomputes the k layers between from it (one more forward, exact)", low=1)
    attention: str = _key("flashmask", "flashmask | sdpa (dense N x N mask) | flex (BlockMask); the baselines need cp none",
                          choices=("flashmask", "sdpa", "flex"))
    tile_chunk: int = _key(0, "run each layer's per-token work over chunks of this many tokens (0: off); a tiled "
                              "layer is its own activation checkpoint (it keeps its input only)", low=0)
    compile: str = _key("auto", "with tile_chunk: the tiled layers' per-token parts (norms, rotary, MLP gate, LoRA, "
                                "residuals) fused by torch.compile; auto: on a GPU, off on the CPU (Inductor needs a "
                                "C++ compiler there)", choices=("auto", "on", "off"))
    memory_plan: str = _key("fixed", "fixed: checkpoint_every and offload_layers as given | auto (GPU): both planned "
                                     "from the model's shape and one layer's memory measured at start, a length that "
                                     "cannot fit refused before the model is built", choices=("fixed", "auto"))
    device_memory_gib: float = _key(0.0, "memory_plan auto: GPU memory the plan aims under (0: 94% of the GPU's, less "
                                         "what other processes hold there)", low=0.0)
    host_memory_gib: float = _key(0.0, "memory_plan auto: host memory each process's offloaded checkpoints may take "
                                       "(0: 75% of the host's, shared by the job's processes on it)", low=0.0)
    attention_chunk: int = _key(65536, "with tile_chunk: FlashMask attention of a tiled layer over query chunks of at "
                                       "most this many rows, cut between documents where possible (0: the whole "
                                       "sequence in one call)", low=0)


# The objectives, one class each in objectives.py (OBJECTIVES, which checks at import that its names are
# these: objectives.py imports this module, so this one cannot read them there).
OBJECTIVE_NAMES = ("sft", "dpo", "rm")


@dataclass
class DataConfig:
    objective: str = _key("sft", "sft (packed documents) | dpo (packed preference samples) | rm (a reward model on "
                          "packed samples of one prompt and K ranked responses)", choices=OBJECTIVE_NAMES,
                          choices_text=", ".join(map(repr, OBJECTIVE_NAMES[:-1])) + f" or {OBJECTIVE_NAMES[-1]!r}")
    path: str = _key("", "a JSONL, Parquet, Arrow or JSON file, a folder of them, or the name of a dataset in the local "
                         "datasets cache, in TRL's formats: sft {\"text\"}, {\"messages\"} or {\"prompt\",\"completion\"}; "
                         "dpo and rm {\"prompt\",\"chosen\",\"rejected\"} (strings or message lists, the prompt may be "
                         "implicit), rm also {\"prompt\",\"responses\":[...],\"scores\":[...]}; empty: the stdlib corpus")
    split: str = _key("train", "the split of data.path (a folder or dataset name with several; a file is one split)")
    assistant_only_loss: bool = _key(True, "sft messages: train on the assistant's tokens only (TRL's assistant_only_loss)")
    completion_only_loss: bool = _key(True, "sft prompt / completion: train on the completion's tokens only (TRL's "
                                            "completion_only_loss)")
    tokenizer: str = _key("", "a local Hugging Face tokenizer folder; empty: bytes")
    seq_len: int = _key(2048, "tokens per packed row", low=2, high=2**31 - 1)
    max_doc_tokens: int = _key(0, "sft: split longer documents into pieces of at most this many tokens, each its own "
                                  "document (0: seq_len)", low=0)
    dpo_layout: str = _key("shared", "dpo rows: shared (one prompt, the dpo mask) | separate (prompt+chosen and "
                           "prompt+rejected as two causal documents, TRL's layout, the prompt computed twice)",
                           choices=DPO_LAYOUTS)


@dataclass
class TrainingConfig:
    steps: int = _key(30, "optimizer steps (or training.epochs)", low=1)
    epochs: float = _key(0.0, "passes over the training data; > 0: the steps are the rows of that many passes over "
                              "the rows per step, rounded up (set it or training.steps, not both); 0: training.steps",
                         low=0.0)
    lr: float = _key(1e-3, "peak learning rate", low=0.0, low_open=True)
    scheduler: str = _key("cosine_with_min_lr", "learning-rate schedule after the warm-up, transformers.get_scheduler's: "
                                                "cosine_with_min_lr (cosine to a tenth of lr) | cosine | linear | constant",
                          choices=("cosine_with_min_lr", "cosine", "linear", "constant"))
    warmup: int = _key(3, "warm-up steps (linear from 0, as transformers' schedules)", low=0)
    weight_decay: float = _key(0.0, "AdamW weight decay on matrices (biases and norm weights never decay, as HF Trainer)",
                               low=0.0)
    max_grad_norm: float = _key(1.0, "clip the gradients' global norm to this (0: no clipping)", low=0.0)
    seed: int = _key(0, "seed of the model's initialisation", low=0)
    grad_accum: int = _key(1, "rows per data-parallel rank per step", low=1)
    loss_chunk: int = _key(1024, "tokens per chunk of the chunked loss (full-vocabulary logits never exist at once)", low=1)
    dpo_beta: float = _key(0.1, "DPO beta", low=0.0, low_open=True)
    reschedule: bool = _key(False, "on --resume, continue under a learning-rate schedule (steps, warmup, lr) other than "
                                   "the checkpoint's (said in one line); false: such a resume is refused")


_CP_IMPLS = tuple(n for n in backends.names() if n == "auto" or backends.get(n).chunked)


@dataclass
class ParallelConfig:
    cp: str = _key("ring", "context parallelism: ring | ulysses | hybrid | none", choices=("ring", "ulysses", "hybrid", "none"))
    cp_degree: int = _key(-1, "ranks per context-parallel group; -1: every rank (no data parallelism)", low=1, special=(-1,))
    ulysses_degree: int = _key(1, "the Ulysses part of hybrid (divides the CP degree)", low=1)
    balance: str = _key("zigzag", "how a row is sharded over CP ranks: contiguous | zigzag | mask",
                        choices=("contiguous", "zigzag", "mask"))
    # The registry's names that run per ring chunk (fm_parallel.backends): a new backend appears here too.
    impl: str = _key("", "attention kernel (" + " | ".join(_CP_IMPLS) + "), with or without CP; empty: automatic",
                     choices=("", *_CP_IMPLS),
                     choices_text=", ".join(n for n in _CP_IMPLS if n != "auto") + " or empty (automatic; 'auto' is the same)")
    cuda_graphs: bool = _key(False, "ring CP only, CUDA + NCCL: each step's attention layers captured once as CUDA graphs "
                                    "and replayed (less host time per layer, about 1 ms more copies per layer)")
    timeout_s: float = _key(600.0, "seconds a collective may wait for a peer before the run fails (a dead or stuck rank)",
                            low=0.0, low_open=True)


@dataclass
class OutputConfig:
    dir: str = _key("runs/default", "run directory: metrics, plot, config, checkpoints, adapter; default with --config "
                                    "FILE: runs/<FILE's name without .toml>")
    checkpoint_every: int = _key(10, "steps between checkpoints (0: only at the end and on a stop)", low=0)
    log_every: int = _key(1, "steps between progress-bar updates", low=1)
    resume: bool = _key(False, "continue from the latest complete checkpoint in dir (also --resume)")
    overwrite: bool = _key(False, "start afresh in a dir that holds an earlier run (its files are deleted)")
    stop_after: int = _key(-1, "stop with a checkpoint after this many steps (time-limited jobs); -1: run to the end",
                           low=1, special=(-1,))


@dataclass
class EvalConfig:
    rows: int = _key(0, "held-out rows evaluated every eval.every steps (0: no evaluation); without eval.path the first "
                        "eval.rows rows of the training stream, never trained on (a row equal to one of them is dropped "
                        "from training by its hash)", low=0)
    path: str = _key("", "held-out data in data.path's forms (its first eval.rows rows); empty: held out of the "
                         "training stream")
    split: str = _key("", "the split of eval.path (empty: data.split for a folder or dataset name; a file is its one "
                          "split)")
    examples: int = _key(0, "held-out examples (records) instead of eval.rows: the first eval.examples records of "
                            "eval.path, or of data.path (training then reads the records after them), packed as "
                            "training packs them", low=0)
    every: int = _key(10, "steps between evaluations (also after the last step)", low=1)


@dataclass
class LoggingConfig:
    tensorboard: bool = _key(False, "TensorBoard event files in output.dir/tensorboard (pip install 'fm_parallel[tensorboard]')")
    wandb: bool = _key(False, "a Weights & Biases run, its files in output.dir/wandb (pip install 'fm_parallel[wandb]')")
    wandb_project: str = _key("fm_parallel", "the W&B project")
    wandb_mode: str = _key("", "W&B mode: online | offline | disabled; empty: wandb's own (WANDB_MODE, else online)",
                           choices=("", "online", "offline", "disabled"), choices_text="online, offline, disabled or empty")
    ema: float = _key(0.9, "smoothing of loss_ema, the exponential moving average of the loss (debiased): the weight "
                           "of the past", low=0.0, high=0.999)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_INT = re.compile(r"^[+-]?\d+$")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _coerce(name: str, value, kind: type, from_text: bool):
    """``value`` as ``kind``, never by rounding or truthiness. ``from_text``: it came from the command
    line or the environment (a string to parse); else from TOML (already typed)."""
    if from_text and isinstance(value, str):
        text = value.strip()
        if kind is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ConfigError(f"{name}: expected a boolean (true or false), got {value!r}")
        if kind is int:
            if _INT.match(text):
                return int(text)
            raise ConfigError(f"{name}: expected int, got {value!r}")
        if kind is float:
            try:
                number = float(text)
            except ValueError:
                raise ConfigError(f"{name}: expected float, got {value!r}") from None
            if not math.isfinite(number):
                raise ConfigError(f"{name}: expected a finite float, got {value!r}")
            return number
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected a boolean (true or false), got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: expected int, got {value!r} ({type(value).__name__})")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{name}: expected a finite float, got {value!r} ({type(value).__name__})")
    if isinstance(value, str):
        return value
    raise ConfigError(f"{name}: expected a string, got {value!r} ({type(value).__name__})")


def _check_range(name: str, value, meta: dict) -> None:
    if meta["choices"] is not None and value not in meta["choices"]:
        names = [str(c) for c in meta["choices"]]
        shown = meta["choices_text"] or (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])
        raise ConfigError(f"{name}: expected {shown}, got {value!r}")
    if value in meta["special"]:
        return
    low, high = meta["low"], meta["high"]
    too_low = low is not None and (value <= low if meta["low_open"] else value < low)
    if too_low or (high is not None and value > high):
        parts = []
        if low is not None:
            parts.append(f"> {low}" if meta["low_open"] else f">= {low}")
        if high is not None:
            parts.append(f"<= {high}")
        expected = " and ".join(parts) + "".join(f" or {s}" for s in meta["special"])
        raise ConfigError(f"{name}: expected a value {expected}, got {value!r}")


def _apply(cfg: Config, section: str, key: str, value, source: str, from_text: bool) -> None:
    sections = [f.name for f in dataclasses.fields(cfg)]
    if section not in sections:
        raise ConfigError(f"{source}: unknown section {section!r}; expected one of {sections}")
    sub = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sub)}
    if key not in fields:
        raise ConfigError(f"{source}: unknown key {section}.{key}; expected one of {list(fields)}")
    f = fields[key]
    kind = type(f.default)
    name = f"{section}.{key}"
    value = _coerce(name, value, kind, from_text)
    _check_range(name, value, f.metadata)
    setattr(sub, key, value)


def _check_relations(cfg: Config) -> None:
    """Rules between keys (each key's own range is checked as it is set)."""
    m, p = cfg.model, cfg.parallel
    if not m.path:
        if m.heads % m.kv_heads:
            raise ConfigError(f"model.kv_heads: expected a divisor of model.heads = {m.heads}, got {m.kv_heads}")
        if m.hidden_size % m.heads:
            raise ConfigError(f"model.hidden_size: expected a multiple of model.heads = {m.heads}, got {m.hidden_size}")
    if not [t for t in m.lora_targets.split(",") if t.strip()]:
        raise ConfigError(f"model.lora_targets: expected at least one module name, got {m.lora_targets!r}")
    if m.offload_optimizer and m.finetune != "full":
        raise ConfigError("model.offload_optimizer: expected model.finetune = 'full' (it places the sharded weights and "
                          "their AdamW state; LoRA's are small), got finetune 'lora'")
    if m.finetune == "full" and m.memory_plan == "auto":
        raise ConfigError("model.memory_plan: expected 'fixed' with model.finetune = 'full' (the plan counts adapters, "
                          "not sharded weights, their gradients and AdamW state yet), got 'auto'")
    if m.lora_dropout and m.tile_chunk:
        raise ConfigError(f"model.lora_dropout: expected 0 with model.tile_chunk = {m.tile_chunk} (a tiled layer recomputes "
                          f"its tiles in the backward without the forward's dropout masks), got {m.lora_dropout}; set "
                          "model.tile_chunk = 0 to train with dropout")
    if m.compile == "on" and not m.tile_chunk:
        raise ConfigError("model.compile: expected model.tile_chunk > 0 with compile on (it compiles the tiled layers' "
                          "parts), got tile_chunk 0; set model.tile_chunk (e.g. 16384) or model.compile = 'auto'")
    if p.cuda_graphs and p.cp != "ring":
        raise ConfigError(f"parallel.cuda_graphs: expected parallel.cp ring (Ulysses and hybrid run eagerly), got cp {p.cp}")
    if p.cp != "hybrid" and p.ulysses_degree != 1:
        raise ConfigError(f"parallel.ulysses_degree: expected 1 unless parallel.cp is hybrid, got {p.ulysses_degree} with cp {p.cp}")
    if not cfg.output.dir.strip():
        raise ConfigError("output.dir: expected a directory path, got an empty string")
    if cfg.output.resume and cfg.output.overwrite:
        raise ConfigError("output.overwrite: expected false when resuming (it would delete the run to resume), got true")
    if cfg.eval.rows and cfg.eval.examples:
        raise ConfigError(f"eval.examples: expected 0 with eval.rows = {cfg.eval.rows} (held-out rows or examples, not "
                          f"both), got {cfg.eval.examples}")
    if cfg.eval.path and not (cfg.eval.rows or cfg.eval.examples):
        raise ConfigError(f"eval.rows: expected the number of rows (or eval.examples, of examples) to evaluate (> 0) with "
                          f"eval.path {cfg.eval.path!r}, got 0")
    _check_extras(cfg)


# A logger asked for must be installed: checked as the config loads, on every rank, before any process
# group exists (a missing package must not leave the other ranks waiting in a collective).
_EXTRAS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def _check_extras(cfg: Config) -> None:
    import importlib

    for key, (module, extra) in _EXTRAS.items():
        if getattr(cfg.logging, key):
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ConfigError(f"logging.{key}: expected the {extra!r} package, not installed ({e}); install it with "
                                  f"pip install 'fm_parallel[{extra}]', or set logging.{key} = false") from None


def eval_split(cfg: Config) -> str:
    """The split of ``eval.path``: ``eval.split``, else a file's one split (``train``), else ``data.split``."""
    if cfg.eval.split:
        return cfg.eval.split
    return "train" if Path(cfg.eval.path).is_file() else cfg.data.split


def model_dtype(cfg: Config, cuda: bool):
    """The torch dtype of the model's weights (``model.dtype``; ``auto``: bfloat16 on a GPU, float32
    on the CPU), as ``build_model`` makes them and the checks before the start count them."""
    import torch

    auto = torch.bfloat16 if cuda and cfg.model.finetune != "full" else torch.float32  # full: float32 master weights
    return {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[cfg.model.dtype]


def _path_config(cfg: Config) -> dict | None:
    """``model.path``'s config.json (None where it cannot be read: the trainer's preflight names a bad folder)."""
    import json

    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def _head_dim(cfg: Config) -> int | None:
    """The attention head size: the built Llama's, or ``model.path``'s config.json (None: unknown)."""
    if not cfg.model.path:
        return cfg.model.hidden_size // cfg.model.heads
    hf = _path_config(cfg)
    try:
        return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    except (AttributeError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None  # a missing or odd folder is the trainer's preflight to name


def check_before_start(cfg: Config, local_processes: int | None = None) -> None:
    """What can be refused before any process group, directory or model exists: more processes on
    this host than GPUs, the kernel against
    the device and dtype the run will use (``parallel.impl``), ``model.offload_layers`` against the
    built Llama's layers, and on a CPU the model and its checkpoints against the host's memory
    (:func:`check_host_memory`, for ``local_processes`` on this host: ``LOCAL_WORLD_SIZE``, else
    1). Raises :class:`ConfigError`, the same on every rank."""
    import torch

    cuda = torch.cuda.is_available()
    local = local_processes or processes_on_this_host()
    if cuda and local > torch.cuda.device_count():
        # each rank takes cuda:LOCAL_RANK: a rank past the last GPU died on "invalid device ordinal"
        # while the others waited for it in their first collective
        raise ConfigError(f"--nproc_per_node: expected at most {torch.cuda.device_count()} processes on this host (one "
                          f"GPU each), got {local}; CUDA_VISIBLE_DEVICES chooses the GPUs, and set empty runs every "
                          f"rank on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = model_dtype(cfg, cuda)
    if cfg.model.attention == "flashmask":
        try:
            backends.resolve(cfg.parallel.impl or None, device, dtype, _head_dim(cfg))
        except ValueError as e:
            raise ConfigError(f"parallel.{e}" if str(e).startswith("impl:") else f"parallel.impl: {e}") from None
    m = cfg.model
    # The layers the run will build: model.layers, or model.path's config.json (read here, before the run
    # directory exists: a refusal after run.json is written would make the corrected command "already a run").
    shape = _decoder_shape(cfg)
    layers = shape["layers"] if shape else None
    where = "model.layers" if not m.path else f"num_hidden_layers in {m.path}/config.json"
    if layers is not None and m.activation_checkpointing and m.offload_layers > layers:
        raise ConfigError(f"model.offload_layers: expected -1 (all) or 0..{layers} ({where}), got {m.offload_layers}")
    if not m.activation_checkpointing and m.offload_layers:
        raise ConfigError(f"model.offload_layers: expected 0 without activation checkpointing, got {m.offload_layers}")
    if layers is not None and m.activation_checkpointing and m.checkpoint_every > layers:
        raise ConfigError(f"model.checkpoint_every: expected 1..{layers} ({where}), got {m.checkpoint_every}")
    if not m.activation_checkpointing and m.checkpoint_every != 1:
        raise ConfigError(f"model.checkpoint_every: expected 1 without activation checkpointing, got {m.checkpoint_every}")
    if not cuda:
        check_host_memory(cfg, local)


def processes_on_this_host() -> int:
    """The job's processes on this host, which share its memory: torchrun's ``LOCAL_WORLD_SIZE``, else 1."""
    import os

    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def _decoder_shape(cfg: Config) -> dict | None:
    """The decoder's shape (``memory.decoder_parameters``' arguments): the built Llama's, or
    ``model.path``'s config.json (None where it cannot be read: the trainer's preflight names a bad folder)."""
    m = cfg.model
    if not m.path:
        return dict(hidden=m.hidden_size, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                    intermediate=m.intermediate_size)
    hf = _path_config(cfg)
    try:
        hf = hf.get("text_config", hf)
        return dict(hidden=int(hf["hidden_size"]), layers=int(hf["num_hidden_layers"]),
                    heads=int(hf["num_attention_heads"]),
                    kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
                    intermediate=int(hf["intermediate_size"]), head_dim=hf.get("head_dim"))
    except (AttributeError, ValueError, KeyError, TypeError):
        return None


def check_host_memory(cfg: Config, local_processes: int = 1, total: int | None = None) -> None:
    """A run on the CPU (no GPU here) whose decoder parameters and activation checkpoints alone exceed
    the host's memory (``MemTotal``, or ``total`` bytes) is refused with a :class:`ConfigError` naming
    both, before anything is built: else a GPU config run on a CPU (``h200_8b_1m.toml``) builds the
    model for minutes and dies out of memory. A lower bound, the same on every rank: each of the
    ``local_processes`` holds the parameters (float32 under ``model.dtype = "auto"``), the
    sequence's checkpoints are held once in all (a checkpoint per ``model.checkpoint_every`` layers,
    every layer's input without checkpointing; a CPU plan keeps one per layer); the embeddings, the
    head and the layers' own activations come on top."""
    from fm_parallel.longcontext.memory import GIB, decoder_parameters, host_memory_bytes

    shape = _decoder_shape(cfg)
    total = host_memory_bytes() if total is None else total
    if shape is None or not total:
        return
    m = cfg.model
    dtype = model_dtype(cfg, cuda=False)
    itemsize = dtype.itemsize
    params = decoder_parameters(**shape)
    every = 1 if not m.activation_checkpointing or m.memory_plan == "auto" else m.checkpoint_every
    kept = -(-shape["layers"] // every)
    n, hidden = cfg.data.seq_len, shape["hidden"]
    weights, checkpoints = local_processes * params * itemsize, kept * n * hidden * itemsize
    if weights + checkpoints <= total:
        return
    dtype = str(dtype).removeprefix("torch.")
    each = f"{local_processes} processes, each" if local_processes > 1 else "1 process"
    key, fix = ("model", "a smaller model") if weights > total else ("data.seq_len", "a shorter data.seq_len")
    raise ConfigError(
        f"{key}: {n} tokens on the CPU (no GPU here) need at least {(weights + checkpoints) / GIB:.1f} GiB of "
        f"host memory ({each} holding the decoder's {params / 1e9:.2f} B parameters in {dtype}, "
        f"{params * itemsize / GIB:.1f} GiB; {kept} activation checkpoints of {n} x {hidden} {dtype}, "
        f"{checkpoints / GIB:.1f} GiB), more than this host's {total / GIB:.1f} GiB: run it on a GPU, or with {fix}")


def describe() -> str:
    """Every key with its type, default and meaning (the text of ``--help``)."""
    lines = ["configuration keys (TOML [section] key = value, --section.key VALUE, or FM_SECTION__KEY=VALUE):"]
    for sec in dataclasses.fields(Config):
        lines.append(f"  [{sec.name}]")
        for f in dataclasses.fields(sec.default_factory()):
            meta = f.metadata
            lines.append(f"    --{sec.name}.{f.name} ({type(f.default).__name__}, default {f.default!r}): {meta['help']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fm_parallel trainer", description="LoRA SFT / DPO with FlashMask attention and context parallelism.",
        epilog=describe(), formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="show this message (every key) and exit")
    parser.add_argument("--config", type=Path, default=None, help="a TOML file of [section] tables")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output.dir")
    return parser


def load_config(argv: list[str] | None = None, environ: dict | None = None) -> Config:
    """Defaults, then ``--config FILE`` (TOML), then ``FM_SECTION__KEY`` variables, then ``--section.key value``.

    ``--help`` prints every key (from rank 0 only under torchrun) and exits with status 0."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.help:
        if os.environ.get("RANK", "0") == "0":
            parser.print_help()
        raise SystemExit(0)
    cfg = Config()
    given: set[str] = set()  # section.key set by the file, the environment or the command line
    if args.config is not None:
        if not args.config.is_file():
            raise ConfigError(f"--config: expected an existing TOML file, got {args.config}")
        try:
            with open(args.config, "rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config: {args.config} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--config: {args.config} is not UTF-8 text: {e}") from None
        for section, values in table.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{args.config}: expected [section] tables, got a top-level {section!r}")
            for key, value in values.items():
                _apply(cfg, section, key, value, str(args.config), from_text=False)
                given.add(f"{section}.{key}")
    for name, value in sorted((os.environ if environ is None else environ).items()):
        if name.startswith("FM_") and "__" in name:
            section, key = name[3:].lower().split("__", 1)
            _apply(cfg, section, key, value, f"environment {name}", from_text=True)
            given.add(f"{section}.{key}")
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or "." not in token:
            raise ConfigError(f"command line: expected --section.key VALUE, got {token!r}")
        name, eq, inline = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(rest):
                raise ConfigError(f"command line: expected a value after {token}")
            inline, i = rest[i + 1], i + 1
        section, key = name.split(".", 1)
        _apply(cfg, section, key, inline, "command line", from_text=True)
        given.add(f"{section}.{key}")
        i += 1
    if args.resume:
        cfg.output.resume = True
    if cfg.training.epochs and "training.steps" in given:
        raise ConfigError(f"training.steps: expected unset with training.epochs = {cfg.training.epochs:g} (the epochs "
                          f"decide the steps), got {cfg.training.steps}; set one of them")
    if args.config is not None and "output.dir" not in given:
        cfg.output.dir = f"runs/{args.config.stem}"  # each config its own run directory: runs never collide by default
    _check_relations(cfg)
    return cfg
