"""What a run reports: one JSON line per step in ``metrics.jsonl`` (rank 0), the progress bar, and
at the end the plot ``training.png`` and a summary.

    log = MetricsLog(out_dir, rank)          # trims what a resumed run logged after its checkpoint
    log.append(step_record(...)); progress.update(record)
    summary = finish(cfg, out_dir, rank, log.path)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from fm_parallel.trainer.config import Config

__all__ = ["MetricsLog", "Progress", "step_started", "step_record", "finish"]


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # an unreadable line was written after any checkpoint: dropped


class MetricsLog:
    """``out_dir/metrics.jsonl``, written by rank 0 only. A run that starts at step ``start``
    (resumed) drops what was logged at or after it: those steps are trained again."""

    def __init__(self, out_dir: Path, rank: int, start: int = 0):
        self.path, self.rank = Path(out_dir) / "metrics.jsonl", rank
        if rank == 0 and self.path.exists():
            # A resumed run drops what was logged after its checkpoint (a fresh one starts in an empty directory).
            kept = [line for line in self.path.read_text().splitlines() if line.strip() and _logged_step(line) < start]
            self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def step_started(device, policy) -> None:
    """A step begins: its peak memory is counted from here, the checkpoint policy's host bytes too."""
    if policy is not None:
        policy.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def step_record(step: int, loss: float, tokens: int, elapsed: float, lr: float, device, policy) -> dict:
    """One step's metrics (collective on CUDA: the peak memory is the largest over the ranks, the one
    that decides whether a length fits). ``policy``: the model's checkpoint policy (host bytes)."""
    record = {"step": step, "loss": loss, "tokens_per_s": tokens / elapsed, "lr": lr, "step_s": elapsed}
    if device.type == "cuda":
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        record["peak_gib"] = peak.item()
    if policy is not None and policy.host_bytes:
        record["host_gib"] = policy.host_bytes / 2**30
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
        step = record["step"]
        if (step + 1) % self.cfg.output.log_every == 0 or step + 1 == self.cfg.training.steps:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def finish(cfg: Config, out_dir: Path, rank: int, metrics_path: Path) -> dict:
    """Rank 0: the plot of loss and throughput, the printed summary; returns the summary ({} elsewhere)."""
    if rank != 0:
        return {}
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] if metrics_path.exists() else []
    if not records:
        return {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [r["step"] for r in records]
    a.plot(steps, [r["loss"] for r in records], "o-", ms=3)
    a.set_xlabel("step")
    a.set_ylabel(f"{cfg.data.objective} loss")
    a.grid(alpha=0.3)
    b.plot(steps, [r["tokens_per_s"] for r in records], "s-", ms=3, color="C1")
    b.set_xlabel("step")
    b.set_ylabel("tokens / s")
    b.grid(alpha=0.3)
    fig.suptitle(f"{cfg.data.objective}, seq_len {cfg.data.seq_len}, cp {cfg.parallel.cp}")
    fig.tight_layout()
    plot = out_dir / "training.png"
    fig.savefig(plot, dpi=110)
    tail = records[len(records) // 2 :] or records
    summary = {
        "plot": str(plot), "metrics": str(metrics_path), "steps": len(records),
        "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
        "tokens_per_s": sum(r["tokens_per_s"] for r in tail) / len(tail),
    }
    if "peak_gib" in records[-1]:
        summary["peak_gib"] = max(r.get("peak_gib", 0.0) for r in records)
    print(f"plot: {plot}")
    print(f"summary: {summary['tokens_per_s']:.0f} tokens/s, loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} "
          f"over {summary['steps']} steps ({cfg.data.objective}, cp={cfg.parallel.cp})")
    return summary
