"""The benchmark harness: what the scripts under launch/bench/ share, so each measures and reports
the same way (BENCHMARKING.md).

* :func:`spread`: repeated measurements summarised one way, min / median / max;
* :func:`error_line`: a failure reported in a row (a peer that cannot run a case, a step out of memory);
* :func:`check_device`: ``--device cuda`` refused at once on a machine without one;
* :func:`init_ranks`, :data:`DTYPES`: the process group of the multi-rank scripts (cp_scaling.py,
  tests/gpu/multi_gpu.py) under torchrun, and the ``--dtype`` names;
* :func:`throughput_vs_length`: the throughput-against-length plot of the training benchmarks
  (trainer_attention.py, train_context.py).

Public names of the library only (tests/test_architecture.py). Heavy imports (torch.distributed's
mesh, matplotlib) stay inside the functions that need them, so a script that only summarises timings
pays for neither.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["spread", "error_line", "check_device", "DTYPES", "init_ranks", "throughput_vs_length"]


# ------------------------------------------------------------------------------------------ timing
def spread(times: Iterable[float]) -> dict:
    """``{"min", "median", "max", "repeats"}`` of repeated measurements, in their unit. The median is
    the figure tables and ratios use; min and max show how still the measurement held."""
    times = list(times)
    if not times:
        raise ValueError("times: expected at least one measurement, got none")
    return {"min": min(times), "median": statistics.median(times), "max": max(times), "repeats": len(times)}


def error_line(e: BaseException, limit: int = 160) -> str:
    """``"Type: first line of the message"`` (at most ``limit`` characters of it): how a row says what
    failed, short enough for a table cell; an exception with no message gives its type alone."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def check_device(parser, device: str, on_a_cpu: str) -> None:
    """``parser.error`` (exit status 2 under the script's usage line) where ``device`` names CUDA and
    this machine has none: a traceback from deep in torch otherwise, or, for a script whose trainer
    falls back to the CPU, rows measured on the wrong device. ``on_a_cpu``: what to run instead."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        parser.error(f"--device {device}: expected a CUDA device, and {why}; {on_a_cpu}")


# ------------------------------------------------------------------------------------------- ranks
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def init_ranks(device_name: str, shared_gpu: bool = False):
    """``(rank, world, device, mesh)``: NCCL on ``cuda`` (one GPU per local rank), gloo on ``cpu``;
    ``shared_gpu``: gloo with every rank on ``cuda:0`` (P processes sharing one GPU; the ring and Ulysses
    stage GPU tensors through the host on gloo). ``mesh`` is a ``("ring", "ulysses")`` DeviceMesh of
    ``world / 2 x 2`` where the world has an even number of ranks, at least 4 (for hybrid runs), else None."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_name not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda or cpu, got {device_name!r}")
    if shared_gpu and device_name != "cuda":
        raise ValueError("--shared-gpu: expected --device cuda (ranks sharing one GPU), got --device cpu")
    cuda = device_name == "cuda"
    from fm_parallel.trainer.config import processes_on_this_host

    local_world = processes_on_this_host()
    if cuda and not shared_gpu and local_world > torch.cuda.device_count():
        # each rank takes cuda:LOCAL_RANK: one past the last GPU died on "invalid device ordinal"
        raise ValueError(f"--nproc_per_node: expected at most {torch.cuda.device_count()} ranks on this host with "
                         f"--device cuda (one GPU each), got {local_world}; --shared-gpu puts every rank on one GPU")
    dist.init_process_group("nccl" if cuda and not shared_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = 0 if shared_gpu else int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = None
    if world >= 4 and world % 2 == 0:
        # The mesh's device type only names where its own tensors would live; the groups use the
        # default backend (gloo when the GPU is shared).
        mesh = init_device_mesh("cpu" if shared_gpu else device.type, (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
    return rank, world, device, mesh


# -------------------------------------------------------------------------------------------- plots
def throughput_vs_length(series: list[tuple[str, list[tuple[int, float]], list[int]]], title: str, path: Path) -> None:
    """One line per ``(label, [(tokens per row, tokens/s) that ran], [tokens per row that did not])``;
    runs that did not fit are x marks on the axis in the line's colour. Log-2 length axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (label, ran, failed) in enumerate(series):
        ran = sorted(ran)
        ax.plot([n for n, _ in ran], [t for _, t in ran], "o-", color=f"C{i}", label=label)
        ax.plot(failed, [0] * len(failed), "x", color=f"C{i}", ms=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("training tokens / s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
