"""The trainer's parallel layout: the process group, the config's CP keys checked against the world,
and one row sharded into the batch a context-parallel rank computes on.

World = data parallel x context parallel. Data-parallel rank ``d`` takes rows ``d, d + dp, ...`` of
every step; the CP ranks of one row each take their shard of it. The mesh, its groups, the row's
context, the sums over a CP group and the sharding are :class:`~fm_parallel.distributed.layout.CPLayout`'s,
the same object the Hugging Face trainers use; the trainer's CP mode (ring, Ulysses, hybrid, none)
is decided here and nowhere else of the trainer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fm_parallel.distributed.context import ContextParallel
from fm_parallel.distributed.layout import CPLayout
from fm_parallel.distributed.prepared import PreparedMask
from fm_parallel.distributed.sharding import length_multiple
from fm_parallel.masks.flashmask import FlashMask
from fm_parallel.trainer.config import Config, ConfigError
from fm_parallel.trainer.data import Row

__all__ = ["init_distributed", "layout", "Batch", "prepare_batch", "device"]


def init_distributed(timeout_s: float) -> None:
    """Join the job's process group; every collective then fails after ``timeout_s`` instead of
    waiting for ever on a dead or stuck rank."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # On a GPU the rank's device is set before the group, and the group is bound to it: NCCL then never
    # guesses the device from the rank ("Guessing device ID ... can cause a hang"), barrier() never
    # warns that it uses "the device under current context", and cuBLAS finds a current context.
    options = {}
    if torch.cuda.is_available():
        options["device_id"] = device()
        torch.cuda.set_device(options["device_id"])
    # Launched by torchrun (or any launcher that sets the env:// rendezvous): join it. A bare WORLD_SIZE=1
    # without MASTER_ADDR is not a launch: accelerate (HF Trainer, TRL) writes it into os.environ once a
    # process group exists, and a later run in that process, or a child of it, would wait for a rendezvous.
    if "MASTER_ADDR" in os.environ or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        dist.init_process_group(backend, timeout=timeout, **options)
        return
    # A plain `python` run is one process: an in-memory store, no TCP port that another job could hold.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **options)


def device() -> torch.device:
    """This rank's device: its local GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def layout(cfg: Config) -> CPLayout:
    """The run's :class:`~fm_parallel.distributed.layout.CPLayout` (the one both front doors use) over
    the current process group; the rules between the CP keys and the world are checked here, naming
    the keys, on every rank, before any model is built."""
    world = dist.get_world_size()
    mode = cfg.parallel.cp
    cp = world if cfg.parallel.cp_degree == -1 else cfg.parallel.cp_degree
    if mode == "none":
        cp = 1
    uly = {"ring": 1, "ulysses": cp, "hybrid": cfg.parallel.ulysses_degree, "none": 1}[mode]
    if cp % uly:
        raise ConfigError(f"parallel.ulysses_degree: expected a divisor of the CP degree {cp}, got {uly}")
    if cfg.model.attention != "flashmask" and cp > 1:
        raise ConfigError(f"model.attention: {cfg.model.attention!r} is a single-device baseline; expected parallel.cp none "
                          f"or a CP degree of 1, got {mode} over {cp} ranks")
    if world % cp:
        raise ConfigError(f"parallel.cp_degree: expected a divisor of the {world} ranks, got {cp}")
    divisor = length_multiple(cp, cfg.parallel.balance)  # shard()'s own rule, checked before any rank builds a model
    if cp > 1 and cfg.data.seq_len % divisor:
        raise ConfigError(f"data.seq_len: expected a multiple of {divisor} (CP degree {cp}, balance {cfg.parallel.balance}), "
                          f"got {cfg.data.seq_len}")
    if cfg.parallel.cuda_graphs and not torch.cuda.is_available():
        raise ConfigError("parallel.cuda_graphs: expected a CUDA run (NCCL ring; gloo's host transfers cannot be "
                          "captured), got a CPU run")
    if cfg.parallel.cuda_graphs and cp == 1:
        raise ConfigError("parallel.cuda_graphs: expected a CP degree above 1 (it captures the ring's layers), got 1 "
                          f"(cp {mode} over {world} rank{'s' if world > 1 else ''})")
    return CPLayout(mode, cp, ulysses=uly, balance=cfg.parallel.balance, impl=cfg.parallel.impl or None,
                    cuda_graphs=cfg.parallel.cuda_graphs)


@dataclass
class Batch:
    """One row as this rank computes on it: ``[1, n]`` tensors (``n = N / cp``, this rank's shard
    under CP) on the device. ``mask``: the step's :class:`PreparedMask` under CP (passed to the
    model as it is: every layer, forward and backward, reuses it), else the row's FlashMask.
    ``ctx``: the row's ContextParallel (None without CP); ``impl``: the kernel without CP.
    ``samples``: the row's sample count (documents for SFT, preference samples for DPO and RM).
    ``scores``: the reward model's ``[samples, K]`` ranking of each sample's responses (whole on every
    rank: it is per sample, not per token), else None."""

    ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    segment: torch.Tensor
    sample: torch.Tensor
    mask: PreparedMask | FlashMask
    ctx: ContextParallel | None
    impl: str
    samples: int
    scores: torch.Tensor | None = None


def prepare_batch(row: Row, lay: CPLayout, cfg: Config, dev: torch.device) -> Batch:
    """Move ``row`` to ``dev`` and, under CP, shard it and prepare its mask (one collective):
    :meth:`CPLayout.shard_row`, the same as the Hugging Face trainers'."""
    n = cfg.data.seq_len
    fields = {"input_ids": row.input_ids, "labels": row.labels, "positions": row.positions, "segment": row.segment,
              "sample": row.sample}
    sharded = lay.shard_row(row.mask, {k: t.view(1, n) for k, t in fields.items()}, dev)
    t = sharded.tensors
    return Batch(t["input_ids"], t["labels"], t["positions"], t["segment"], t["sample"], mask=sharded.mask, ctx=sharded.ctx,
                 impl=cfg.parallel.impl or "auto", samples=int(row.sample.max()) + 1,
                 scores=None if row.scores is None else row.scores.to(dev))
