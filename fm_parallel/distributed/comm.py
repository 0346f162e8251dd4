"""Point-to-point pairing for ring schedules, and the cross-rank agreement check.

The ring here is a schedule of direct transfers: in step ``s`` rank ``r`` may send its own chunk to
``r + s`` and receive the chunk of ``r - s`` (mod P). Each step is a permutation, so the links are
loaded evenly as in a pass-along ring, and a chunk goes only to ranks that need it: nothing is
forwarded through ranks that would not use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["RingComm", "check_agreement", "check_cp_inputs"]


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


def check_cp_inputs(q, k, v, mask, plan, group) -> tuple[int, int]:
    """The checks every context-parallel attention call makes; returns ``(world, rank)`` of the group.

    Ranks first agree on shapes, the mask and the plan (one all_gather), so that a mismatch raises the
    same ValueError on every rank instead of hanging in a collective that its peers never join.
    """
    if not dist.is_initialized():
        raise ValueError("group: expected an initialised torch.distributed process group, got none")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(plan, ShardPlan) or plan.world_size != world:
        got = plan.world_size if isinstance(plan, ShardPlan) else type(plan).__name__
        raise ValueError(f"plan: expected a ShardPlan for the group's {world} ranks, got {got}")
    if not isinstance(mask, FlashMask) or mask.num_keys != plan.num_tokens:
        got = mask.num_keys if isinstance(mask, FlashMask) else type(mask).__name__
        raise ValueError(f"mask: expected a FlashMask with {plan.num_tokens} key columns (the plan's N), got {got}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a [B, H, N/P, D] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    check_agreement(
        [n_local, k.shape[2], b, hq, hkv, d, v.shape[-1], plan.num_tokens, mask.digest(), plan.digest()],
        ["q length", "k length", "batch", "query heads", "kv heads", "head dim", "value dim", "plan tokens", "mask", "plan"],
        group,
    )
    if n_local != plan.local_tokens or k.shape[2] != n_local or v.shape[2] != n_local:
        raise ValueError(f"q, k, v: expected {plan.local_tokens} local tokens (N / P), got {n_local}, {k.shape[2]}, {v.shape[2]}")
    if k.shape[:2] != v.shape[:2] or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"k, v: expected [B={b}, H_kv, N/P, D={d}] alike, got {tuple(k.shape)} and {tuple(v.shape)}")
    if mask.device != q.device:
        raise ValueError(f"mask: expected device {q.device} like q, got {mask.device}")
    return world, rank
