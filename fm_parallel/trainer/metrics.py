"""What a run reports: one JSON line per step in ``metrics.jsonl`` (rank 0), the progress bar,
held-out evaluation, TensorBoard / W&B, and at the end the plot ``training.png`` and a summary.

    held = HeldOut(cfg, objective, tokenizer)          # eval rows; held.train_stream(stream) drops them
    log = MetricsLog(out_dir, rank, start, cfg)        # trims what a resumed run logged; TensorBoard / W&B
    progress.update(log.append(step_record(...)))      # the record gets loss_ema; logged everywhere
    if held.due(step): progress.write(log.append(held.evaluate(...)))
    summary = finish(cfg, out_dir, rank, log)          # plot, summary; the loggers closed

A training line holds ``step, loss, loss_ema, learning_rate, grad_norm, memory_gib, tokens_per_s`` (the
tokens trained on, padding not counted; ``padding_tokens`` beside), ``step_s``
(HF Trainer's names where it has one; ``epoch`` with a data file or ``training.epochs``; DPO and reward
models add TRL's per-step metrics, ``rewards/chosen``, ...; and
``peak_gib``, ``tflops`` per GPU and ``mfu`` on GPU, ``host_gib`` with offloaded checkpoints); an evaluation line ``step, eval_loss,
eval_rows`` (DPO: ``eval_reward_accuracy, eval_reward_margin``, TRL's rewards/accuracies and margins).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from fm_parallel.trainer.config import Config, ConfigError, eval_split
from fm_parallel.trainer.data import Row

__all__ = ["MetricsLog", "Progress", "HeldOut", "Loggers", "row_digest", "memory_gib", "ema", "step_started", "step_record",
           "compile_seconds", "first_step_costs", "plot", "finish", "step_sums"]


def step_sums(sums: dict, names: tuple[str, ...], device) -> dict[str, float]:
    """The objective's per-step metrics (:attr:`Objective.STEP_SUMS`): this rank's ``sums`` of the step's
    rows summed over the world (collective) and divided by their ``count``; {} for none."""
    if not names:
        return {}
    flat = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64).reshape(()) for k in names]).to(device)
    dist.all_reduce(flat)
    values = dict(zip(names, flat.tolist()))
    count = max(values.pop("count"), 1e-12)
    return {k: v / count for k, v in values.items()}


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line was written after any checkpoint: dropped


class MetricsLog:
    """``out_dir/metrics.jsonl``, written by rank 0 only, and with ``cfg`` the run's :class:`Loggers`
    (TensorBoard, W&B) fed the same records. A run that starts at step ``start`` (resumed) drops what
    was logged at or after it: those steps are trained again. Each training record gets ``loss_ema``
    (:func:`ema` of the losses so far, weight ``logging.ema``), continued on resume."""

    def __init__(self, out_dir: Path, rank: int, start: int = 0, cfg: Config | None = None):
        self.path, self.rank = Path(out_dir) / "metrics.jsonl", rank
        self.weight = cfg.logging.ema if cfg is not None else 0.9
        self.losses: list[float] = []
        if rank == 0 and self.path.exists():
            # A resumed run drops what was logged after its checkpoint (a fresh one starts in an empty directory).
            # Records count the steps done: a run resumed after ``start`` steps keeps those up to ``start``.
            kept = [line for line in self.path.read_text().splitlines() if line.strip() and _logged_step(line) <= start]
            self.path.write_text("".join(line + "\n" for line in kept))
            self.losses = [r["loss"] for r in map(json.loads, kept) if "loss" in r]
        self.loggers = Loggers(cfg, Path(out_dir), rank, start) if cfg is not None else None

    def append(self, record: dict) -> dict:
        """Write ``record`` (a training record gets its ``loss_ema``) and log it; returns it."""
        if "loss" in record:
            self.losses.append(record["loss"])
            record["loss_ema"] = ema(self.losses, self.weight)[-1]
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.loggers is not None:
            self.loggers.log(record, "eval" if "eval_loss" in record else "train")
        return record

    def close(self) -> None:
        if self.loggers is not None:
            self.loggers.close()


def step_started(device, policy) -> float:
    """A step begins: its peak memory is counted from here, the checkpoint policy's host bytes too.
    Returns :func:`compile_seconds` so far, for the step's record (``compiled_since``)."""
    if policy is not None:
        policy.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return compile_seconds()


def compile_seconds() -> float:
    """Seconds this process has spent in ``torch.compile`` so far (tracing and code generation, forward
    and backward graphs: dynamo's own ``total_wall_time``; 0.0 where this torch does not count it). A
    step's share is the difference across it: what makes the first step at a new shape slower."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private counter: its absence must not stop training
        return 0.0


def first_step_costs(policy, compiled_since: float | None) -> dict:
    """What a step spent outside its computation, where nonzero: ``compile_s`` (``torch.compile``
    since ``compiled_since``) and ``host_alloc_s`` (allocating the offloaded checkpoints' host buffers,
    :class:`~fm_parallel.longcontext.memory.CheckpointPolicy`). Both are paid by a process's first step at a
    length and shrink to about zero on the next."""
    costs = {}
    compiled = compile_seconds() - compiled_since if compiled_since is not None else 0.0
    if compiled > 0:
        costs["compile_s"] = compiled
    if policy is not None and policy.host_alloc_s:
        costs["host_alloc_s"] = policy.host_alloc_s
    return costs


def allocator_stats(device) -> dict:
    """The CUDA caching allocator's view of ``device`` since the peak was last reset: ``reserved_gib``,
    the most it reserved (above the peak allocated: fragmentation), and ``alloc_retries``, its flushes
    so far (each frees every cached block and waits for the device: a run close to the GPU's memory
    that slows down shows it here)."""
    return {"alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
            "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def step_record(step: int, loss: float, tokens: int, elapsed: float, lr: float, device, policy,
                grad_norm: float | None = None, flops: float | None = None,
                compiled_since: float | None = None, padding: int | None = None) -> dict:
    """One step's metrics (collective: the memory is the largest over the ranks, the one that decides
    whether a length fits; :func:`memory_gib`). ``policy``: the model's checkpoint policy (host bytes);
    ``grad_norm``: the world's gradient norm before clipping (``clip_grad_norm_``'s return); ``flops``:
    what the whole step computed (:func:`~fm_parallel.trainer.flops.rows_flops`): on a GPU the record
    gets ``tflops`` per GPU and ``mfu``, their share of the GPU's dense bf16 peak; ``compiled_since``:
    :func:`step_started`'s return (the record gets :func:`first_step_costs`, this rank's). ``tokens``:
    the tokens trained on (``tokens_per_s`` counts them); ``padding``: the rows' padding positions
    beside them (``padding_tokens``), never counted as throughput."""
    record = {"step": step + 1, "loss": loss, "learning_rate": lr}  # steps done, as the bar counts them
    if flops and device.type == "cuda":
        from fm_parallel.trainer.flops import peak_tflops

        record["tflops"] = flops / elapsed / dist.get_world_size() / 1e12
        peak = peak_tflops(torch.cuda.get_device_name(device))
        if peak:
            record["mfu"] = record["tflops"] / peak
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    memory = torch.tensor(memory_gib(device), device=device, dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    record["memory_gib"] = memory.item()
    if device.type == "cuda":
        record["peak_gib"] = record["memory_gib"]  # the name earlier runs and scripts read
        record.update(allocator_stats(device))  # this rank's
    record.update(tokens_per_s=tokens / elapsed, step_s=elapsed)
    if padding is not None:
        record["padding_tokens"] = padding  # the rows' positions that are padding: not counted in tokens_per_s
    if policy is not None and policy.host_bytes:
        record["host_gib"] = policy.host_bytes / 2**30
    record.update(first_step_costs(policy, compiled_since))
    return record


class Progress:
    """Rank 0's progress bar (nothing on the other ranks); the loss shown every ``output.log_every`` steps."""

    def __init__(self, cfg: Config, rank: int, start: int, desc: str):
        self.cfg, self.bar = cfg, None
        if rank == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.training.steps, initial=min(start, cfg.training.steps), desc=desc, unit="step")

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        done = record["step"]  # steps done
        if done % self.cfg.output.log_every == 0 or done == self.cfg.training.steps:
            shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['learning_rate']:.2e}"}
            if "grad_norm" in record:
                shown["gnorm"] = f"{record['grad_norm']:.3f}"
            if "memory_gib" in record:
                shown["mem"] = f"{record['memory_gib']:.2f}G"
            shown["tok_s"] = f"{record['tokens_per_s']:.0f}"
            if "tflops" in record:
                shown["tflops"] = f"{record['tflops']:.0f}" + (f" ({record['mfu']:.0%} MFU)" if "mfu" in record else "")
            self.bar.set_postfix(shown)
        self.bar.update(1)

    def note(self, text: str) -> None:
        """A line printed above the bar (rank 0)."""
        if self.bar is not None:
            self.bar.write(text)

    def write(self, record: dict) -> None:
        """An evaluation's line, printed above the bar (rank 0)."""
        if self.bar is None:
            return
        extra = "".join(f", {k.removeprefix('eval_').replace('_', ' ')} {v:.4f}" for k, v in record.items()
                        if k.startswith("eval_") and k not in ("eval_loss", "eval_rows", "eval_examples"))
        examples = f" ({record['eval_examples']} examples)" if "eval_examples" in record else ""
        self.bar.write(f"step {record['step']}: eval loss {record['eval_loss']:.4f} over {record['eval_rows']} held-out "
                       f"rows{examples}{extra}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot(cfg: Config, records: list[dict], path: Path):
    """The plot of a run's ``metrics.jsonl`` records, saved to ``path``; returns the figure. Left: the
    loss of each step (raw), its ``loss_ema`` line and the evaluations' losses; right: throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in train]
    a.plot(steps, [r["loss"] for r in train], "o-", ms=2, lw=0.8, alpha=0.45, color="C0", label="loss")
    smoothed = [r["loss_ema"] for r in train]
    if not all("loss_ema" in r for r in train):  # records of a run from before loss_ema was logged
        smoothed = ema([r["loss"] for r in train], cfg.logging.ema)
    a.plot(steps, smoothed, "-", lw=2, color="C0", label=f"EMA {cfg.logging.ema:g}")
    if evals:
        a.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "D--", ms=5, color="C3", label="eval loss")
    a.set_xlabel("step")
    a.set_ylabel(f"{cfg.data.objective} loss")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    b.plot(steps, [r["tokens_per_s"] for r in train], "s-", ms=3, color="C1")
    b.set_xlabel("step")
    b.set_ylabel("tokens / s")
    b.grid(alpha=0.3)
    fig.suptitle(f"{cfg.data.objective}, seq_len {cfg.data.seq_len}, cp {cfg.parallel.cp}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # the figure object stays readable (its lines); pyplot no longer holds it
    return fig


def finish(cfg: Config, out_dir: Path, rank: int, log: MetricsLog | Path) -> dict:
    """Rank 0: the plot (:func:`plot`), the printed summary; returns the summary ({} elsewhere).
    ``log``: the run's :class:`MetricsLog` (its loggers are closed here) or its ``metrics.jsonl``."""
    if isinstance(log, MetricsLog):
        log.close()
    metrics_path = log.path if isinstance(log, MetricsLog) else Path(log)
    if rank != 0:
        return {}
    lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] if metrics_path.exists() else []
    records = [r for r in lines if "loss" in r]
    if not records:
        return {}
    evals = [r for r in lines if "eval_loss" in r]
    path = out_dir / "training.png"
    plot(cfg, lines, path)
    tail = records[len(records) // 2 :] or records
    summary = {
        "plot": str(path), "metrics": str(metrics_path), "steps": len(records),
        "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
        "final_loss_ema": records[-1].get("loss_ema", records[-1]["loss"]),
        "tokens_per_s": sum(r["tokens_per_s"] for r in tail) / len(tail),
    }
    if "peak_gib" in records[-1]:
        summary["peak_gib"] = max(r.get("peak_gib", 0.0) for r in records)
    said = ""
    if evals:
        summary["eval_loss"] = [r["eval_loss"] for r in evals]
        said = f"; eval loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}"
        if "eval_reward_accuracy" in evals[-1]:
            summary["eval_reward_accuracy"] = evals[-1]["eval_reward_accuracy"]
            said += f", reward accuracy {evals[-1]['eval_reward_accuracy']:.2f}"
    print(f"plot: {path}")
    print(f"summary: {summary['tokens_per_s']:.0f} tokens/s, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} "
          f"over {summary['steps']} steps ({cfg.data.objective}, cp={cfg.parallel.cp}); smoothed {summary['final_loss_ema']:.4f} "
          f"(EMA {cfg.logging.ema:g}){said}")
    return summary


# ----------------------------------------------------------------- held-out evaluation
def row_digest(row: Row) -> bytes:
    """A row's content hash (its tokens, segments and samples): how a held-out row is recognised when
    the stream brings it round again."""
    h = hashlib.blake2b(digest_size=16)
    for t in (row.input_ids, row.segment, row.sample):
        h.update(t.contiguous().numpy().tobytes())
    return h.digest()


class HeldOut:
    """The ``eval`` section: ``eval.rows`` held-out rows, and the training stream without them.

    Without ``eval.path`` the held-out rows are the first ``eval.rows`` rows of the training stream;
    every row of the stream whose :func:`row_digest` is one of theirs is dropped from training (the
    stream repeats the data, so they come round again each pass). With ``eval.path`` they are that
    file's first rows and the training stream is untouched. The same on every rank (the streams are)."""

    def __init__(self, cfg: Config, objective, tokenizer):
        self.cfg, self.rows, self.digests = cfg, [], set()
        # The records of each pass that training reads: all, or those after eval.examples held out.
        self.train_window: tuple[int, int | None] = (0, None)
        self.examples = 0  # held-out examples (records), when eval.examples chose them
        e = cfg.eval
        if e.examples:
            self._hold_examples(objective, tokenizer)
            return
        if not e.rows:
            return
        stream = self._source(objective, tokenizer)[0].rows(tokenizer)
        seen: set[bytes] = set()
        repeated = False
        for row in stream:  # the rows, and (held out of the stream) one more: it must be left to train on
            digest = row_digest(row)
            repeated = digest in seen  # the data came round again: one pass holds only the rows seen
            if repeated or len(self.rows) == e.rows:
                break
            seen.add(digest)
            self.rows.append(row)
            if e.path and len(self.rows) == e.rows:
                break
        if e.path and len(self.rows) < e.rows:
            raise ConfigError(f"eval.rows: expected at most the {len(self.rows)} rows that eval.path {e.path!r} packs "
                              f"into (data.seq_len {cfg.data.seq_len}), got {e.rows}")
        if not e.path and repeated:
            raise ConfigError(f"eval.rows: expected fewer rows than the {len(self.rows)} of one pass over the training "
                              f"data (data.seq_len {cfg.data.seq_len}), got {e.rows}: none would be left to train on")
        self.digests = set() if e.path else seen

    def _source(self, objective, tokenizer):
        """``(the objective reading the held-out data, its record count)``: with ``eval.path``, the run's
        objective on that source (its records checked, as the training data's are); else
        ``(objective, None)``, the training data."""
        e = self.cfg.eval
        if not e.path:
            return objective, None
        split = eval_split(self.cfg)
        count = objective.validate(e.path, tokenizer, key="eval.path", split=split)
        data = dataclasses.replace(self.cfg.data, path=e.path, split=split)
        return type(objective)(dataclasses.replace(self.cfg, data=data)), count

    def _hold_examples(self, objective, tokenizer) -> None:
        """``eval.examples``: the first examples of ``eval.path`` (or of the training data, which then
        starts after them), packed into rows as training packs them."""
        from fm_parallel.trainer.sources import records

        e = self.cfg.eval
        source, total = self._source(objective, tokenizer)
        path = source.cfg.data.path
        if path:
            if total is None:  # the training data's records (checked by the preflight): counted here
                total = sum(1 for _ in records(path, source.cfg.data.split, "data.path"))
            where = f"{'eval.path' if e.path else 'data.path'} {path!r}"
            if e.examples > total or (not e.path and e.examples >= total):
                more = "at most" if e.path else "fewer than"
                raise ConfigError(f"eval.examples: expected {more} the {total} examples of {where}"
                                  + ("" if e.path else " (the rest are trained on)") + f", got {e.examples}")
        self.rows = list(source.rows(tokenizer, passes=1, window=(0, e.examples)))
        self.examples = e.examples
        if not e.path:
            self.train_window = (e.examples, None)

    def train_stream(self, stream):
        """``stream`` without the held-out rows (read with :attr:`train_window`)."""
        if not self.digests:
            yield from stream
            return
        dropped = 0
        for row in stream:
            if row_digest(row) in self.digests:
                dropped += 1
                # Held-out rows are a pass's first rows: more of them in a row than were held out means
                # every row of a pass is held out, and training would wait for ever.
                if dropped > len(self.digests):
                    raise ConfigError(f"eval.rows: expected fewer rows than one pass over the training data holds, "
                                      f"got {self.cfg.eval.rows}: every row is held out, none is left to train on")
                continue
            dropped = 0
            yield row

    def due(self, step: int) -> bool:
        """Evaluate after this step: every ``eval.every`` steps and after the last."""
        return bool(self.rows) and ((step + 1) % self.cfg.eval.every == 0 or step + 1 == self.cfg.training.steps)

    @torch.no_grad()
    def evaluate(self, objective, model, lay, device, step: int) -> dict:
        """The held-out loss over every held-out row (collective: each data-parallel rank takes its
        share, summed over the world), normalised as a training step's loss is (tokens for SFT,
        samples for DPO); DPO adds TRL's reward accuracy and mean reward margin."""
        from fm_parallel.trainer import parallel
        from fm_parallel.trainer.fsdp import ShardedModel, in_root

        was_training = model.training
        model.eval()
        totals = None
        mine = self.rows[lay.dp_rank :: lay.dp]
        # A sharded model's forward is collective over every rank (FSDP gathers each layer's weights):
        # every rank runs as many rows as the busiest one, the extra ones counted zero times.
        rounds = -(-len(self.rows) // lay.dp) if isinstance(model, ShardedModel) else len(mine)
        for i in range(rounds):
            row = mine[i] if i < len(mine) else self.rows[0]
            sums = in_root(model, objective.eval_sums, model, parallel.prepare_batch(row, lay, self.cfg, device), lay)
            if i >= len(mine):
                sums = {k: v * 0 for k, v in sums.items()}
            totals = sums if totals is None else {k: totals[k] + v for k, v in sums.items()}
        if totals is None:  # a data-parallel rank with no held-out row still joins the sum
            totals = {k: torch.zeros((), device=device, dtype=torch.float64) for k in objective.EVAL_SUMS}
        keys = list(objective.EVAL_SUMS)
        flat = torch.stack([totals[k].double().reshape(()) for k in keys]).to(device)
        dist.all_reduce(flat)
        model.train(was_training)
        values = dict(zip(keys, flat.tolist()))
        count = max(values.pop("count"), 1.0)
        record = {"step": step + 1, "eval_loss": values.pop("loss") / count, "eval_rows": len(self.rows)}
        if self.examples:
            record["eval_examples"] = self.examples
        record.update({f"eval_{k}": v / count for k, v in values.items()})
        return record


# ----------------------------------------------------------------- loggers
class Loggers:
    """TensorBoard and Weights & Biases, through their own libraries, on rank 0 (``logging`` section;
    both off by default, their packages the extras ``[tensorboard]`` and ``[wandb]``, checked when the
    config loads). Every number of a record is logged under ``train/`` or ``eval/`` at its step."""

    def __init__(self, cfg: Config, out_dir: Path, rank: int, start: int):
        self.tb = self.wb = None
        if rank != 0:
            return
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run hides the events logged after its checkpoint (trained again).
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=start + 1 if start else None)
        if cfg.logging.wandb:
            import wandb

            (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
            id_file = out_dir / "wandb" / "run_id"  # a resumed run continues the same W&B run
            run_id = id_file.read_text().strip() if start and id_file.exists() else None
            self.wb = wandb.init(project=cfg.logging.wandb_project, dir=str(out_dir), id=run_id,
                                 resume="allow" if run_id else None, name=out_dir.name, config=cfg.to_dict(),
                                 mode=cfg.logging.wandb_mode or None)
            id_file.write_text(self.wb.id)

    def log(self, record: dict, split: str = "train") -> None:
        step = record["step"]
        scalars = {f"{split}/{k.removeprefix('eval_')}": v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def memory_gib(device) -> float:
    """This step's peak memory in GiB: on a GPU the peak allocated by torch since the step began; on
    the CPU the process's peak resident set so far (``ru_maxrss``, KiB on Linux; it never falls)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def ema(values: list[float], weight: float) -> list[float]:
    """The debiased exponential moving average (TensorBoard's smoothing): ``m = w m + (1 - w) x`` from
    ``m = 0``, divided by ``1 - w^(t + 1)`` so the first values are not pulled towards zero."""
    out, m = [], 0.0
    for t, x in enumerate(values):
        m = weight * m + (1 - weight) * x
        out.append(m / (1 - weight ** (t + 1)))
    return out
