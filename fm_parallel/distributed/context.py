"""One object that says how attention is parallelised, for integrations that call attention per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fm_parallel.distributed.hybrid import hybrid_attention
from fm_parallel.distributed.ring import RingStats, ring_attention
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.distributed.ulysses import ulysses_attention
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ContextParallel", "CP_MODES"]

CP_MODES = ("ring", "ulysses", "hybrid")


@dataclass
class ContextParallel:
    """How this rank's attention calls are spread: ``mode`` over ``group`` (ring, Ulysses) or ``mesh`` (hybrid).

    Args:
        mode: ``"ring"``, ``"ulysses"`` or ``"hybrid"``.
        plan: the sharding plan, the same on every rank of the group.
        group: the context-parallel process group (ring, Ulysses; default: the world).
        mesh: a 2-D DeviceMesh with dims ("ring", "ulysses") (hybrid).
        impl: the local kernel (None: Triton on CUDA, PyTorch on CPU).
        stats: accumulates the ring's transfer counts over calls.
    """

    mode: str
    plan: ShardPlan
    group: object = None
    mesh: object = None
    impl: str | None = None
    stats: RingStats | None = None

    def __post_init__(self):
        if self.mode not in CP_MODES:
            raise ValueError(f"mode: expected one of {CP_MODES}, got {self.mode!r}")
        if not isinstance(self.plan, ShardPlan):
            raise ValueError(f"plan: expected a ShardPlan, got {type(self.plan).__name__}")
        if self.mode == "hybrid" and self.mesh is None:
            raise ValueError("mesh: expected a 2-D DeviceMesh ('ring', 'ulysses') for mode='hybrid', got None")

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlashMask, scale=None) -> torch.Tensor:
        """``[B, H, N / P, D]`` local tensors in, this rank's ``[B, Hq, N / P, Dv]`` rows out."""
        if self.mode == "ring":
            return ring_attention(q, k, v, mask, self.plan, self.group, scale=scale, impl=self.impl, stats=self.stats)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, mask, self.plan, self.group, scale=scale, impl=self.impl or "auto")
        return hybrid_attention(q, k, v, mask, self.plan, self.mesh, scale=scale, impl=self.impl, stats=self.stats)
