"""Run directories and checkpoints that never mix runs, never resume from damaged bytes.

A run directory holds one run: ``run.json`` (the configuration that made it), ``metrics.jsonl``,
``training.png``, ``checkpoints/step_NNNNNN/`` and ``adapter/`` (the peft export). Rules:

* a fresh run refuses a directory that holds anything, unless ``output.overwrite`` (then the earlier
  run's files are deleted; files that no run writes are never deleted: the run refuses);
* ``--resume`` refuses when the model, LoRA, data or sequence length differ from the run's, naming
  every difference;
* a checkpoint is complete only once ``checksums.json`` (SHA-256 of every file) and ``complete`` are
  written; resuming verifies every file against it and refuses a damaged one, naming it;
* the progress counters read back are bounded by what the run can have done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from fm_parallel.trainer.config import Config, ConfigError

__all__ = ["RUN_FILE", "saved_config", "check_run_dir", "clear_run_dir", "config_differences", "write_checksums",
           "verify_checkpoint", "latest_checkpoint", "load_failure", "CheckpointError", "StopRequested"]

RUN_FILE = "run.json"
# What a run writes at the top of its directory (older runs wrote config.json).
RUN_ENTRIES = {RUN_FILE, "config.json", "metrics.jsonl", "training.png", "checkpoints", "adapter", "base_model",
               "tensorboard", "wandb"}
# What must be equal to resume: the model and adapter being trained and the data stream it reads.
RESUME_KEYS = {
    "model": ("path", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "dtype", "lora_rank",
              "lora_alpha", "lora_targets", "attention"),
    "data": ("objective", "path", "split", "tokenizer", "seq_len", "max_doc_tokens", "assistant_only_loss",
             "completion_only_loss"),
    "training": ("seed", "grad_accum"),
    "eval": ("rows", "path", "split", "examples"),  # the held-out set (without eval.path its rows are dropped from the training stream)
}
CHECKSUMS = "checksums.json"


class StopRequested(Exception):
    """A stop (SIGTERM / Ctrl-C) arrived during a long loop that has nothing to save."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (damaged, incomplete, inconsistent)."""


def saved_config(out: Path, argument: str = "output.dir", use: str = "resumed") -> dict | None:
    """The configuration a run directory was made with (``run.json``, or an older run's ``config.json``).

    ``argument`` / ``use``: what the error names (the trainer's ``output.dir`` that cannot be resumed,
    the export command's ``run_dir`` that cannot be exported)."""
    for name in (RUN_FILE, "config.json"):
        path = out / name
        if path.exists():
            try:
                saved = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{argument}: {path} is damaged ({e}); it cannot be {use}") from None
            if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
                raise ConfigError(f"{argument}: {path} is damaged (expected {{section: {{key: value}}}}); it cannot be {use}")
            return saved
    return None


def config_differences(saved: dict, cfg: Config) -> list[str]:
    """``section.key: saved -> now`` for every key that must not change on resume."""
    now = cfg.to_dict()
    diffs = []
    for section, keys in RESUME_KEYS.items():
        for key in keys:
            before = saved.get(section, {}).get(key, now[section][key])
            if before != now[section][key]:
                diffs.append(f"{section}.{key}: {before!r} -> {now[section][key]!r}")
    return diffs


def check_run_dir(cfg: Config) -> None:
    """Refuse an output directory that would mix this run with another (every rank calls this, before
    anything is written; raises :class:`ConfigError`)."""
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: expected a directory, got the file {out}")
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output.dir: {existing} is not writable, so {out} cannot hold a run")
    # Hidden files (.gitkeep, .DS_Store) are neither a run nor the user's data: they neither block nor get deleted.
    entries = sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) if out.is_dir() else []
    if cfg.output.resume:
        saved = saved_config(out)
        if saved is None:
            raise ConfigError(f"--resume: expected a complete checkpoint under {out / 'checkpoints'}, found none "
                              f"({'no directory' if not out.is_dir() else 'no run in ' + str(out)})")
        diffs = config_differences(saved, cfg)
        if diffs:
            raise ConfigError(f"--resume: the run in {out} was made with other settings; refusing to mix them: "
                              + "; ".join(diffs) + " (start a new run in another output.dir, or restore the settings)")
        return
    if not entries:
        return
    foreign = [e for e in entries if e not in RUN_ENTRIES]
    if foreign:
        raise ConfigError(f"output.dir: {out} holds files that are not a run's ({', '.join(foreign[:5])}); "
                          "choose an empty or new directory")
    if not cfg.output.overwrite:
        raise ConfigError(f"output.dir: {out} already holds a run ({', '.join(entries)}); pass --resume to continue it, "
                          "--output.overwrite true to replace it, or choose another directory")


def clear_run_dir(cfg: Config) -> None:
    """Delete an earlier run's files (``output.overwrite``; rank 0 only, after :func:`check_run_dir`)."""
    out = Path(cfg.output.dir)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        if entry.name in RUN_ENTRIES:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _sha256(path: Path, stop=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            if stop is not None and stop():
                raise StopRequested(f"stop requested while hashing {path}")
    return h.hexdigest()


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in (CHECKSUMS, "complete"))


def write_checksums(path: Path) -> None:
    """``checksums.json``: SHA-256 and size of every file of the checkpoint (written before ``complete``)."""
    table = {str(p.relative_to(path)): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in _files(path)}
    tmp = path / (CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path / CHECKSUMS)


def verify_checkpoint(path: Path, stop=None, argument: str = "--resume") -> None:
    """Raise :class:`CheckpointError` naming the first file that is missing, extra or damaged.

    ``argument``: what the error names (the trainer's ``--resume``, the export command's ``checkpoint``)."""
    listing = path / CHECKSUMS
    if not listing.exists():
        raise CheckpointError(f"{argument}: {path} has no {CHECKSUMS} (written by an older version or cut short); "
                              "its bytes cannot be verified. Delete it to resume from an earlier checkpoint")
    try:
        table = json.loads(listing.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{argument}: {listing} is damaged ({e})") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) and {"sha256", "bytes"} <= set(v) for v in table.values()):
        raise CheckpointError(f"{argument}: {listing} is damaged (expected {{file: {{sha256, bytes}}}})")
    present = {str(p.relative_to(path)) for p in _files(path)}
    missing = sorted(set(table) - present)
    if missing:
        raise CheckpointError(f"{argument}: {path} is missing {missing[:3]}; delete the checkpoint to resume from an earlier one")
    for name, entry in table.items():
        file = path / name
        if file.stat().st_size != entry.get("bytes") or _sha256(file, stop) != entry.get("sha256"):
            raise CheckpointError(f"{argument}: {file} does not match its checksum (the checkpoint is damaged); "
                                  f"delete {path} to resume from an earlier checkpoint")


def latest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint marked complete."""
    root = out / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "complete").exists()) if root.exists() else []
    return done[-1] if done else None


def load_failure(path: Path, error: BaseException, argument: str) -> CheckpointError:
    """One line for a checkpoint that ``torch.distributed.checkpoint`` could not read: the first rank's
    underlying error (dcp wraps each rank's error in a ``CheckpointException``, a ``BaseException``
    whose text is a multi-line traceback), never the stack."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    lines = str(error).strip().splitlines()
    cause = type(error).__name__ + (f": {lines[0][:300]}" if lines else "")
    if isinstance(error, EOFError):  # torch.load's unpickler says nothing more
        cause += " (a file ends early: truncated)"
    unverified = "" if (path / CHECKSUMS).exists() else f"; it has no {CHECKSUMS} (an older run), so its files were not verified"
    return CheckpointError(f"{argument}: {path} cannot be loaded ({cause}){unverified}; the checkpoint is damaged or "
                           "incomplete: use an earlier one")
