"""The training loop: LoRA SFT / DPO on packed rows with FlashMask attention and context parallelism.

Every rank walks the same stream of packed rows (:mod:`.objectives`); a step's rows are split over the
data-parallel ranks, each row sharded over its CP ranks (:mod:`.parallel`). Losses are normalised by the
step's global token (or sample) count and gradients summed over the world (:mod:`.optimizer`): every
layout computes one process's update. Model: :mod:`.model`; resume: :mod:`.checkpoint`; :mod:`.metrics`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fm_parallel.distributed.comm import RankFailure
from fm_parallel.quiet import silence_known_harmless
from fm_parallel.trainer import checkpoint, metrics, parallel, runs
from fm_parallel.trainer.capacity import plan_run
from fm_parallel.trainer.config import Config, ConfigError, check_before_start, load_config
from fm_parallel.trainer.data import DataError
from fm_parallel.trainer.export import save_base_model
from fm_parallel.trainer.flops import rows_flops
from fm_parallel.trainer.fsdp import in_root
from fm_parallel.longcontext.memory import GIB, plan_shortfall, prefer_expandable_segments
from fm_parallel.trainer.model import build_model, build_tokenizer, compiles
from fm_parallel.trainer.objectives import objective as make_objective, rows_per_pass
from fm_parallel.trainer.optimizer import build_optimizer, set_learning_rate, update
from fm_parallel.trainer.preflight import preflight
from fm_parallel.user_errors import exit_with_user_error

__all__ = ["main", "train", "USER_ERRORS"]


def train(cfg: Config) -> dict:
    """Run training as configured; returns the summary (also printed and written by rank 0)."""
    silence_known_harmless()  # by message, each with its reason: fm_parallel/quiet.py
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True  # finish the step (or the loop in progress), write a checkpoint, exit

    previous = {s_: signal.signal(s_, on_signal) for s_ in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _train(cfg, lambda: stop["flag"])
    finally:
        for s_, handler in previous.items():
            signal.signal(s_, handler)


def _train(cfg: Config, stopped) -> dict:
    expandable = prefer_expandable_segments()  # before anything touches CUDA
    check_before_start(cfg)  # the kernel against the device, ...: refused before anything is created
    tokenizer = build_tokenizer(cfg)
    preflight(cfg, tokenizer, stopped)
    held = metrics.HeldOut(cfg, make_objective(cfg), tokenizer)  # the eval rows, checked before anything starts
    parallel.init_distributed(cfg.parallel.timeout_s)
    rank, out_dir = dist.get_rank(), Path(cfg.output.dir)
    say = lambda text: print(text, flush=True) if rank == 0 else None  # noqa: E731
    if expandable:
        say("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by the trainer: long rows fragment fixed "
            "segments; set the variable yourself to choose)")
    runs.check_run_dir(cfg)  # every rank, before anything is written
    lay = parallel.layout(cfg)
    per_pass = rows_per_pass(cfg, make_objective(cfg), tokenizer, len(held.digests), held.train_window)
    if cfg.training.epochs:  # the steps of that many passes (before run.json and the schedule read them)
        cfg.training.steps = max(1, math.ceil(cfg.training.epochs * per_pass / (lay.dp * cfg.training.grad_accum)))
        say(f"training.epochs = {cfg.training.epochs:g}: {per_pass} rows per pass, {lay.dp * cfg.training.grad_accum} "
            f"per step: {cfg.training.steps} steps")
    device = parallel.device()
    plan = plan_run(cfg, device, tokenizer.vocab_size, cp=lay.cp, say=say)  # auto: planned (or refused) before any build
    dist.barrier()  # no rank writes until every rank has checked the directory
    if rank == 0:
        if cfg.output.overwrite:
            runs.clear_run_dir(cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.output.resume:
            (out_dir / runs.RUN_FILE).write_text(json.dumps(cfg.to_dict(), indent=1))
    fresh = rank == 0 and not cfg.output.resume
    objective = make_objective(cfg)
    model = build_model(cfg, tokenizer.vocab_size, device, head=objective.HEAD, reference=objective.REFERENCE,
                        save_base=(lambda base: save_base_model(base, out_dir / "base_model")) if fresh else None)
    if compiles(cfg, device):
        say(f"model.compile = {cfg.model.compile}: the tiled layers' per-token parts run through torch.compile "
            "(the first step includes compiling them)")
    params, optim = build_optimizer(model, cfg)
    rows_per_step = lay.dp * cfg.training.grad_accum
    stream = held.train_stream(objective.rows(tokenizer, window=held.train_window))
    start, rows_done, interrupted = checkpoint.resume(cfg, model, optim, rows_per_step, stream, stopped, say)
    if interrupted:
        return {}
    log = metrics.MetricsLog(out_dir, rank, start, cfg)
    if start >= cfg.training.steps:
        say(f"nothing to train: the run already reached training.steps = {cfg.training.steps}")
    progress = metrics.Progress(cfg, rank, start, f"{cfg.data.objective} {lay.mode} x{lay.cp} dp{lay.dp}")
    policy, saved, plan_missed = model.checkpoint_policy, None, False
    for step in range(start, cfg.training.steps):
        t0 = time.perf_counter()
        compiled_since = metrics.step_started(device, policy)
        rows = [next(stream) for _ in range(rows_per_step)]
        rows_done += len(rows)
        denom = objective.denominator(rows)
        lr = set_learning_rate(optim, cfg, step)
        local_loss, sums = torch.zeros((), device=device, dtype=torch.float64), {}
        for row in rows[lay.dp_rank :: lay.dp]:
            loss, row_sums = in_root(model, objective.loss_and_sums, model, parallel.prepare_batch(row, lay, cfg, device), lay)
            (loss / denom).backward()
            local_loss += loss.detach().double() / denom
            sums = {k: sums.get(k, 0.0) + v.detach().double().cpu() for k, v in row_sums.items()}
        grad_norm = update(params, optim, cfg.training.max_grad_norm)  # the whole world's gradients; losses were normalised globally
        dist.all_reduce(local_loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        flops = rows_flops(cfg, model.get_base_model().config, rows) if device.type == "cuda" else None  # MFU: GPU only
        tokens = sum(int((row.sample >= 0).sum()) for row in rows)  # the rows' documents: padding is no throughput
        record = metrics.step_record(step, local_loss.item(), tokens, time.perf_counter() - t0, lr, device, policy,
                                     grad_norm, flops, compiled_since, padding=len(rows) * cfg.data.seq_len - tokens)
        record.update(metrics.step_sums(sums, objective.STEP_SUMS, device))
        if per_pass:
            record["epoch"] = rows_done / per_pass
        if plan is not None:
            record["planned_gib"] = plan.device_bytes / GIB
            missed = plan_shortfall(plan, record["memory_gib"] * GIB)  # the largest over the ranks: all agree
            if missed and not plan_missed:
                progress.note(f"warning: {missed}")
                plan_missed = True
        progress.update(log.append(record))
        if held.due(step):
            progress.write(log.append(held.evaluate(objective, model, lay, device, step)))
        last = step == cfg.training.steps - 1
        flag = torch.tensor(1 if stopped() else 0, device=device)  # NCCL reduces device tensors only
        dist.all_reduce(flag)  # every rank stops at the same step
        stopping = bool(flag.item()) or step + 1 == cfg.output.stop_after
        if (cfg.output.checkpoint_every and (step + 1) % cfg.output.checkpoint_every == 0) or last or stopping:
            saved = checkpoint.save(cfg, model, optim, step, rows_done, rows_per_step, tokenizer)
        if stopping and not last:
            progress.close()
            say(f"stopped after {step + 1} of {cfg.training.steps} steps; checkpoint {saved}; continue with --resume")
            break
    progress.close()
    if not stopped():
        checkpoint.publish_adapter(cfg, saved, say)
    summary = metrics.finish(cfg, out_dir, rank, log)
    dist.barrier()
    return summary


USER_ERRORS = (ConfigError, DataError, ValueError, FileNotFoundError, PermissionError, RankFailure)


def main(argv: list[str] | None = None) -> None:
    """The command line. A user error (configuration, data, folders, a checkpoint that cannot be
    resumed, ranks that disagree) prints one ``error:`` line and exits with status 2, no traceback
    (:mod:`fm_parallel.user_errors`: rank 0's line, or another rank's when rank 0 did not report
    it); ``FM_TRACEBACK=1`` shows the traceback."""
    try:
        cfg = load_config(argv)
        train(cfg)
    except USER_ERRORS as e:
        if os.environ.get("FM_TRACEBACK"):
            raise
        exit_with_user_error(e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

