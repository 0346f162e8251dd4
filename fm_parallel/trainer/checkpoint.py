"""Checkpoints: a distributed checkpoint per save (the adapter, the optimizer, the progress counters
and each rank's RNG), the adapter beside it in peft format, checksums, and resuming from the latest
complete one (restore, then skip the rows already trained on).

    path = save(cfg, model, optim, step, rows_done, rows_per_step, tokenizer)
    step, rows_done, rows_per_step = load(path, model, optim, stop)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

from fm_parallel.trainer import runs
from fm_parallel.trainer.config import Config, ConfigError
from fm_parallel.trainer.export import export_adapter, export_model
from fm_parallel.trainer.optimizer import SCHEDULE_KEYS, learning_rate

__all__ = ["checkpoint_dir", "save", "load", "resume", "check_schedule", "publish_adapter", "SCHEDULE_FILE"]

# The learning-rate schedule a checkpoint was trained under, beside its tensors (and checksummed with them).
SCHEDULE_FILE = "schedule.json"
# The shape of optimizer.learning_rate (a new shape gets a new name, so an old checkpoint's is told apart).
SCHEDULE_KIND = "transformers.get_scheduler"


def checkpoint_dir(cfg: Config, done: int) -> Path:
    """The checkpoint after ``done`` steps: ``step_NNNNNN`` counts the steps it holds (as the progress bar,
    ``metrics.jsonl`` and the evaluation lines count them; HF's ``checkpoint-N``)."""
    return Path(cfg.output.dir) / "checkpoints" / f"step_{done:06d}"


def save(cfg: Config, model, optim, step: int, rows_done: int, rows_per_step: int, tokenizer) -> Path:
    """A distributed checkpoint (adapter + optimizer + progress + each rank's RNG) and the adapter in
    peft format; complete once every file's checksum is written. Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    path = checkpoint_dir(cfg, step + 1)
    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(ignore_frozen_params=True))
    progress = {"step": torch.tensor(step), "rows": torch.tensor(rows_done), "rows_per_step": torch.tensor(rows_per_step)}
    dcp.save({"model": model_sd, "optim": optim_sd, "progress": progress}, checkpoint_id=str(path))
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(rng, path / f"rng_rank{dist.get_rank()}.pt")
    if cfg.model.finetune == "full":  # every rank gives its shards of the whole model
        export_model(model, path / "model", cfg, tokenizer, step + 1)
    if dist.get_rank() == 0:  # LoRA weights are the same on every rank (gradients are all-reduced)
        (path / SCHEDULE_FILE).write_text(json.dumps(_schedule(cfg), indent=1))
        if cfg.model.finetune != "full":
            export_adapter(model, path / "adapter", cfg, tokenizer, step + 1)
    dist.barrier()
    if dist.get_rank() == 0:
        runs.write_checksums(path)
        (path / "complete").write_text("ok")  # a checkpoint cut short by a kill is never resumed from
    return path


def load(path: Path, model, optim, stop) -> tuple[int, int, int]:
    """Restore a verified checkpoint; returns (step, rows done, rows per step)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    runs.verify_checkpoint(path, stop)
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=options)
    progress = {"step": torch.tensor(-1), "rows": torch.tensor(-1), "rows_per_step": torch.tensor(0)}
    state = {"model": model_sd, "optim": optim_sd, "progress": progress}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - verified bytes dcp cannot read (a damaged write re-signed)
        raise runs.load_failure(path, e, "--resume") from None
    # Only the adapter was saved: the frozen base weights come from the model build, not the checkpoint.
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    rng_path = path / f"rng_rank{dist.get_rank()}.pt"
    if not rng_path.exists():
        raise runs.CheckpointError(f"--resume: {path} was written by fewer ranks (no {rng_path.name}); resume with the same "
                                   "number of ranks")
    rng = torch.load(rng_path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    step, rows = int(state["progress"]["step"]), int(state["progress"]["rows"])
    per_step = int(state["progress"]["rows_per_step"])
    # Bound the counters by what the run can have done: a damaged counter must not spin the data stream.
    if step < 0 or rows < 0 or (per_step and rows != (step + 1) * per_step) or rows > (step + 1) * 2**20:
        raise runs.CheckpointError(f"--resume: {path} holds inconsistent progress (step {step}, rows {rows}, "
                                   f"rows per step {per_step}); delete it to resume from an earlier checkpoint")
    return step, rows, per_step


def _schedule(cfg: Config) -> dict:
    sections = cfg.to_dict()
    values = {key: sections[key.split(".")[0]][key.split(".")[1]] for key in SCHEDULE_KEYS}
    return values | {"schedule": SCHEDULE_KIND}


def _saved_schedule(path: Path) -> dict:
    """The schedule checkpoint ``path`` was trained under: its ``schedule.json``, else (a checkpoint
    written before it existed) the run's ``run.json``, whose keys are the run's first schedule."""
    if (path / SCHEDULE_FILE).is_file():
        try:
            return json.loads((path / SCHEDULE_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise runs.CheckpointError(f"--resume: {path / SCHEDULE_FILE} is damaged ({e})") from None
    saved = runs.saved_config(path.parent.parent) or {}
    return {key: saved[key.split(".")[0]][key.split(".")[1]] for key in SCHEDULE_KEYS
            if key.split(".")[1] in saved.get(key.split(".")[0], {})}


def check_schedule(cfg: Config, say) -> None:
    """On ``--resume`` (every rank, before anything is restored): a learning-rate schedule other than
    the latest checkpoint's (steps, warm-up, peak, kind) would re-stretch the rest of the run
    silently, so it is refused, naming each key with both values, unless ``training.reschedule``;
    then one line says what changed and the learning rate the run continues with."""
    latest = runs.latest_checkpoint(Path(cfg.output.dir)) if cfg.output.resume else None
    if latest is None:
        return  # a fresh run, or none to resume (resume() says so)
    saved, now = _saved_schedule(latest), _schedule(cfg)
    changed = [key for key in now if key in saved and saved[key] != now[key]]
    if not changed:
        return
    text = "; ".join(f"{key}: {saved[key]!r} -> {now[key]!r}" for key in changed)
    if not cfg.training.reschedule:
        raise ConfigError(f"--resume: the learning-rate schedule differs from the one {latest} was trained under: {text}; "
                          "pass --training.reschedule true to continue under the new schedule, or restore the settings")
    step = int(latest.name.split("_")[-1])  # the steps it holds: the next step's index
    before = copy.deepcopy(cfg)
    for key in changed:
        if key.startswith("training."):
            setattr(before.training, key.split(".")[1], saved[key])
    say(f"note: training.reschedule: resuming {latest.name} under a new schedule ({text}); the learning rate at step "
        f"{step + 1} is {learning_rate(cfg, step):.4g} (the checkpoint's schedule: {learning_rate(before, step):.4g})")


def resume(cfg: Config, model, optim, rows_per_step: int, stream, stop, say) -> tuple[int, int, bool]:
    """Restore the latest complete checkpoint of ``output.dir`` and advance ``stream`` past the rows
    it trained on. Returns ``(start, rows_done, interrupted)``: the first step to train, the rows of
    the stream consumed, and whether a stop arrived meanwhile (nothing trained; the checkpoint
    stands). A fresh run: ``(0, 0, False)``. ``stop()``: a stop was requested; ``say``: rank 0's print."""
    if not cfg.output.resume:
        return 0, 0, False
    check_schedule(cfg, say)
    out_dir = Path(cfg.output.dir)
    latest = runs.latest_checkpoint(out_dir)
    if latest is None:
        raise ConfigError(f"--resume: expected a complete checkpoint under {out_dir / 'checkpoints'}, found none")
    try:
        step, rows_done, saved_per_step = load(latest, model, optim, stop)
    except runs.StopRequested:
        say(f"stopped while verifying {latest}; nothing was changed")
        return 0, 0, True
    say(f"resumed from {latest} ({step + 1} steps done, {rows_done} rows done)")
    if saved_per_step and saved_per_step != rows_per_step:
        say(f"note: rows per step changed from {saved_per_step} to {rows_per_step} (data-parallel degree)")
    skipping = range(rows_done)
    if dist.get_rank() == 0 and rows_done > 64:
        from tqdm import tqdm

        skipping = tqdm(skipping, desc="resume: skipping rows already trained on", unit="row", leave=False)
    for _ in skipping:
        if stop():  # a stop while skipping: nothing new was trained, the checkpoint stands
            say(f"stopped while resuming; the last checkpoint is still {runs.latest_checkpoint(out_dir)}")
            return 0, 0, True
        next(stream)
    return step + 1, rows_done, False


def publish_adapter(cfg: Config, saved: Path | None, say) -> None:
    """Rank 0, after a run that reached ``training.steps``: the last checkpoint's adapter becomes the
    run's ``adapter/`` (a stopped run leaves the previous one)."""
    if dist.get_rank() != 0 or saved is None or saved.name != checkpoint_dir(cfg, cfg.training.steps).name:
        return
    import shutil

    full = cfg.model.finetune == "full"
    final = Path(cfg.output.dir) / ("model" if full else "adapter")
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(saved / final.name, final)
    say(f"model: {final} (from_pretrained)" if full else f"adapter: {final} (PeftModel.from_pretrained)")
