"""Point-to-point pairing for ring schedules, and the cross-rank agreement check.

The ring here is a schedule of direct transfers: in step ``s`` rank ``r`` may send its own chunk to
``r + s`` and receive the chunk of ``r - s`` (mod P). Each step is a permutation, so the links are
loaded evenly as in a pass-along ring, and a chunk goes only to ranks that need it: nothing is
forwarded through ranks that would not use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["RingComm", "check_agreement"]


class RingComm:
    """Owns the p2p pairing of one process group."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def peer(self, group_rank: int) -> int:
        """Global rank of a rank of the group (p2p ops take global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def send_to(self, step: int) -> int:
        return (self.rank + step) % self.world_size

    def recv_from(self, step: int) -> int:
        return (self.rank - step) % self.world_size

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        """Post isend/irecv for (tensor, group rank) pairs; returns the requests to wait on."""
        ops = [dist.P2POp(dist.isend, t, self.peer(r), self.group) for t, r in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peer(r), self.group) for t, r in recvs]
        return dist.batch_isend_irecv(ops) if ops else []


def check_agreement(values: list[int], names: list[str], group=None) -> None:
    """All ranks compare ``values``; every rank raises the same ValueError when they differ.

    One small all_gather, so a rank with a different sequence length or mask fails loudly instead of
    hanging in a transfer that its peers never post.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor(values, dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    for i, name in enumerate(names):
        column = table[:, i]
        if not bool((column == column[0]).all()):
            raise ValueError(f"{name}: expected the same value on every rank, got {column.tolist()} (by rank)")
