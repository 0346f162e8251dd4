"""Shared by the multi-rank scripts (cp_scaling.py, tests/gpu/multi_gpu.py): start the process group
under torchrun and describe this rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

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
