"""A validated description of how ranks divide the work: data parallel x ring x Ulysses."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """``world_size = dp * ring * ulysses``; context parallel degree ``cp = ring * ulysses``.

    Build the process grid with :meth:`build_mesh` (``torch.distributed.device_mesh``): dims
    ``("dp", "ring", "ulysses")``, Ulysses innermost so its all-to-alls stay on the fastest links.
    """

    world_size: int
    ring: int = 1
    ulysses: int = 1

    def __post_init__(self):
        for name in ("world_size", "ring", "ulysses"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.world_size % self.cp:
            raise ValueError(
                f"world_size: expected a multiple of ring x ulysses = {self.ring} x {self.ulysses} = {self.cp}, "
                f"got {self.world_size}"
            )

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    @classmethod
    def from_env(cls, ring: int = 1, ulysses: int = 1) -> "ParallelDims":
        """From the initialised default process group."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed: expected an initialised process group, got none")
        return cls(dist.get_world_size(), ring, ulysses)

    def build_mesh(self, device_type: str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.ring, self.ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
