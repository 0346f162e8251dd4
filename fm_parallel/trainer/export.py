"""The trained adapter in peft's own format, loadable with ``PeftModel.from_pretrained``.

The trainer writes ``adapter/`` into every checkpoint and into the run directory at the end:
``adapter_config.json`` + ``adapter_model.safetensors`` (peft's ``save_pretrained``), the tokenizer
(a Hugging Face one is saved beside the adapter; the byte tokenizer is named in ``fm_parallel.json``),
the base model's config (``base_model_config.json``) and where its weights are: ``model.path`` when the run fine-tuned a local model, else ``base_model/`` of the
run directory, where a model built from the config saved its initial weights once.

Convert a checkpoint written before adapters were exported (or re-export one):

    python -m fm_parallel.trainer.export runs/cpu_sft                       # latest complete checkpoint
    python -m fm_parallel.trainer.export runs/cpu_sft --checkpoint runs/cpu_sft/checkpoints/step_000050
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["export_adapter", "save_base_model", "convert_checkpoint", "BASE_SAVE_LIMIT_BYTES"]

# A model built from the config has random base weights that no folder holds; they are saved with the
# run unless larger than this (an 8B-shaped benchmark model), when the adapter names the recipe only.
BASE_SAVE_LIMIT_BYTES = 4 * 2**30


def save_base_model(base, path: Path) -> bool:
    """Save a config-built base model (before LoRA is injected) so adapters load onto it; False when
    skipped for size."""
    size = sum(p.numel() * p.element_size() for p in base.parameters())
    if size > BASE_SAVE_LIMIT_BYTES:
        return False
    path.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(path)
    return True


def _auto_class(base) -> str:
    """The ``transformers`` Auto class that loads ``base``'s kind: a reward model (a sequence classifier
    with one output, its ``score`` head) or a causal LM."""
    return "AutoModelForSequenceClassification" if hasattr(base, "score") else "AutoModelForCausalLM"


def _tokenizer_files(path: Path, cfg, tokenizer) -> dict:
    """Save a Hugging Face tokenizer beside an export (the byte tokenizer has no files) and return what
    ``fm_parallel.json`` says of it."""
    hf_tokenizer = getattr(tokenizer, "tok", None)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(str(path))
    return {"tokenizer": cfg.data.tokenizer or "bytes (UTF-8 bytes, 256 = document separator, 257 = padding)",
            "vocab_size": tokenizer.vocab_size}


def export_adapter(model, path: Path, cfg, tokenizer, step: int) -> Path:
    """Write ``model``'s LoRA adapter in peft format to ``path`` (rank 0; the adapter is the same on
    every rank). ``cfg``: the run's Config; ``tokenizer``: the trainer's tokenizer."""
    out_dir = Path(cfg.output.dir).resolve()
    if cfg.model.path:
        base = str(Path(cfg.model.path).resolve())
    else:
        base = str(out_dir / "base_model") if (out_dir / "base_model" / "config.json").exists() else ""
    peft_config = model.peft_config["default"]
    previous = peft_config.base_model_name_or_path
    peft_config.base_model_name_or_path = base
    try:
        model.save_pretrained(str(path))
    finally:
        peft_config.base_model_name_or_path = previous
    # The base model's architecture travels with the adapter even when its weights are not saved.
    base_model = model.get_base_model()
    auto = _auto_class(base_model)
    extra = ", num_labels=1" if auto == "AutoModelForSequenceClassification" else ""  # a base folder may hold another head
    (path / "base_model_config.json").write_text(base_model.config.to_json_string())
    info = {
        "step": step,
        "base_model": base or None,
        "base_model_recipe": None if base else {k: v for k, v in cfg.to_dict()["model"].items()} | {"seed": cfg.training.seed},
        **_tokenizer_files(path, cfg, tokenizer),
        "load": f"PeftModel.from_pretrained({auto}.from_pretrained(base_model{extra}), this folder)",
        # adapter_config.json names the base where it was at export (an absolute path): a moved run
        # folder, or a base model moved elsewhere, loads the same way with the base's new place.
        "if_moved": f"PeftModel.from_pretrained({auto}.from_pretrained('<where the base model is now>'{extra}), "
                    "this folder): base_model_name_or_path is only the default AutoPeftModel reads",
    }
    (path / "fm_parallel.json").write_text(json.dumps(info, indent=1))
    return path


def export_model(model, path: Path, cfg, tokenizer, step: int) -> Path:
    """Write the whole model of a ``model.finetune = "full"`` run as a ``save_pretrained`` folder
    (safetensors, its config, the tokenizer) that ``AutoModelForCausalLM`` (a reward model:
    ``AutoModelForSequenceClassification``) loads. Collective: every rank gives its shards, rank 0
    gathers them on the host and writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        base = model.get_base_model()
        weights = {k.removeprefix("base."): v for k, v in state.items()}  # ShardedModel holds the HF model as .base
        path.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(str(path), state_dict=weights)
        info = {"step": step, **_tokenizer_files(path, cfg, tokenizer), "load": f"{_auto_class(base)}.from_pretrained(this folder)"}
        (path / "fm_parallel.json").write_text(json.dumps(info, indent=1))
    dist.barrier()
    return path


def convert_checkpoint(run_dir: str | Path, checkpoint: str | Path | None = None, out: str | Path | None = None) -> Path:
    """Export the adapter of a trainer checkpoint (default: the latest complete one) in peft format;
    returns the folder written (default ``<checkpoint>/adapter``). One process, on the CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from fm_parallel.trainer import runs
    from fm_parallel.trainer.config import Config, ConfigError
    from fm_parallel.trainer.model import build_model, build_tokenizer
    from fm_parallel.trainer.objectives import objective

    run_dir = Path(run_dir)
    saved = runs.saved_config(run_dir, "run_dir", "exported")
    if saved is None:
        raise ConfigError(f"run_dir: expected a trainer run directory with {runs.RUN_FILE}, got {run_dir}")
    cfg = Config()
    for section, values in saved.items():
        for key, value in values.items():
            if hasattr(getattr(cfg, section, None), key):
                setattr(getattr(cfg, section), key, value)
    cfg.output.dir = str(run_dir)
    path = Path(checkpoint) if checkpoint else runs.latest_checkpoint(run_dir)
    if path is None or not (path / "complete").exists():
        raise ConfigError(f"checkpoint: expected a complete checkpoint, got {path or 'none under ' + str(run_dir / 'checkpoints')}")
    if (path / runs.CHECKSUMS).exists():  # an older run's checkpoint has none: dcp's own read errors are caught below
        runs.verify_checkpoint(path, argument="checkpoint")
    if cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: the run fine-tuned {cfg.model.path!r} ({run_dir / runs.RUN_FILE}), which holds no "
                          "config.json now; expected the base model's local Hugging Face folder there")
    if cfg.model.finetune == "full":  # its weights are sharded over the run's ranks; the whole model is already written
        raise ConfigError(f"run_dir: expected a LoRA run (an adapter to convert), got a model.finetune = 'full' run, whose "
                          f"checkpoints each hold the whole model as a save_pretrained folder: {path / 'model'}")
    tokenizer = build_tokenizer(cfg)
    cfg.model.activation_checkpointing, cfg.model.offload_layers, cfg.model.tile_chunk = False, 0, 0
    model = build_model(cfg, tokenizer.vocab_size, torch.device("cpu"), head=objective(cfg).HEAD)
    options = StateDictOptions(ignore_frozen_params=True)
    state = {"model": get_model_state_dict(model, options=options)}
    try:
        # The metadata read first: a missing or truncated .metadata makes dcp.load log two tracebacks before it fails.
        dcp.FileSystemReader(str(path)).read_metadata()
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a truncated shard, a missing or damaged .metadata
        raise runs.load_failure(path, e, "checkpoint") from None
    set_model_state_dict(model, state["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    step = int(path.name.split("_")[-1]) if path.name.startswith("step_") else -1
    return export_adapter(model, Path(out) if out else path / "adapter", cfg, tokenizer, step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fm_parallel.trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the trainer's output.dir")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint folder (default: the latest complete one)")
    parser.add_argument("--out", default=None, help="where to write the adapter (default: <checkpoint>/adapter)")
    args = parser.parse_args(argv)
    from fm_parallel.quiet import silence_known_harmless

    silence_known_harmless()  # by message, each with its reason: fm_parallel/quiet.py
    try:
        path = convert_checkpoint(args.run_dir, args.checkpoint, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:  # the adapter could not be written (--out not writable, a full disk)
        print(f"error: --out: cannot write the adapter ({e})", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"adapter: {path}")


if __name__ == "__main__":
    main()
