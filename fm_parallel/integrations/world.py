"""Whether the Hugging Face stack runs over every rank the launcher started.

torchrun (or any env:// launcher) starts ``WORLD_SIZE`` processes, but the ``Trainer`` and accelerate
decide for themselves whether to run distributed: on a machine without a GPU only with
``TrainingArguments(use_cpu=True)``. Otherwise every rank runs the Trainer as one process of its own:
its data loader is not sharded and no gradient is summed, so each rank trains apart (transformers
only logs that a process group exists). With DeepSpeed's Ulysses (ALST) the sequence-parallel group
then trains each rank's copy of one batch: every row twice. Everything of ours that relies on
accelerate's notion of "distributed" checks it here, on every rank (each sees the same world and
the same settings, so each raises the same error; none waits for a peer).

    check_trainer_world(trainer.args)                    # context_parallel(Trainer), FlashMaskDPOTrainer
    check_processes(accelerator.num_processes)           # ulysses_parallelism_config's accelerator check
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["launched_world", "check_processes", "check_trainer_world"]


def launched_world() -> int:
    """The processes the launcher started: the process group's size, else ``WORLD_SIZE`` (1 unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_processes(processes: int) -> None:
    """Raise ``ValueError`` when the HF stack runs over ``processes`` ranks but the launcher started
    another number, naming the fix: ``use_cpu=True`` on a machine without a GPU (where that is the
    only cause accelerate has), else the launch."""
    world = launched_world()
    if world <= 1 or processes == world:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"use_cpu: expected True when {world} ranks run on a machine without a GPU (TrainingArguments"
                         f"(use_cpu=True): only then does accelerate run the Trainer over the ranks; otherwise each rank "
                         f"trains apart, with no gradient sum), got False")
    raise ValueError(f"args: expected a Trainer distributed over the {world} launched ranks (one process per GPU, "
                     f"launched by torchrun or accelerate launch), got {processes} process(es): each rank would train "
                     f"apart, with no gradient sum")


def check_trainer_world(args) -> None:
    """:func:`check_processes` for a ``TrainingArguments`` (its ``world_size`` is accelerate's count)."""
    check_processes(args.world_size)
