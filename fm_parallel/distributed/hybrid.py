"""Hybrid context parallelism: Ulysses inside, ring outside, over a 2-D process grid.

The grid is a ``torch.distributed.device_mesh.DeviceMesh`` with dims ``("ring", "ulysses")``
(``ParallelDims.build_mesh()["ring", "ulysses"]``); context-parallel rank ``ring_idx * U + uly_idx``
holds ``plan.positions`` of that index. Inside a Ulysses group the all-to-all gathers the group's
tokens for ``H / U`` heads; across groups a ring with exact transfer skipping does the rest.
"""

from __future__ import annotations

import torch

from fm_parallel.distributed.comm import check_cp_inputs
from fm_parallel.distributed.ring import RingStats, ring_attention
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.distributed.ulysses import _rank_mask, heads_to_seq, seq_to_heads, ulysses_heads
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["hybrid_attention", "group_plan"]


def group_plan(plan: ShardPlan, ring: int, ulysses: int) -> tuple[ShardPlan, list[torch.Tensor]]:
    """The ring's plan over Ulysses groups (each group's tokens, sorted), and per group the order
    that sorts the tokens as the all-to-all delivers them (member 0's, then member 1's...)."""
    key = ("hybrid", ring, ulysses)
    if key not in plan._cache:
        merged = [torch.cat([plan.positions[g * ulysses + u] for u in range(ulysses)]) for g in range(ring)]
        sorts = [torch.sort(m) for m in merged]
        plan._cache[key] = (ShardPlan([s.values for s in sorts], plan.num_tokens, plan.balance), [s.indices for s in sorts])
    return plan._cache[key]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask,
    plan: ShardPlan,
    mesh,
    *,
    scale: float | None = None,
    impl: str | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """FlashMask attention over a ring x Ulysses grid.

    Args:
        q: ``[B, Hq, N / (R U), D]``; k, v: ``[B, Hkv, N / (R U), D]``, this rank's tokens in the
            order of ``plan.positions[ring_idx * U + uly_idx]``.
        mesh: 2-D DeviceMesh with dims ``("ring", "ulysses")``.
        plan: over ``R * U`` ranks. stats: the ring's transfer counts for this rank.
    Returns:
        ``[B, Hq, N / (R U), Dv]``. Differentiable.
    """
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or tuple(names) != ("ring", "ulysses"):
        raise ValueError(f"mesh: expected a 2-D DeviceMesh with dims ('ring', 'ulysses'), got dims {names}")
    r, u = mesh["ring"].size(), mesh["ulysses"].size()
    if not isinstance(plan, ShardPlan) or plan.world_size != r * u:
        got = plan.world_size if isinstance(plan, ShardPlan) else type(plan).__name__
        raise ValueError(f"plan: expected a ShardPlan over ring x ulysses = {r} x {u} = {r * u} ranks, got {got}")
    ring_group, uly_group = mesh.get_group("ring"), mesh.get_group("ulysses")
    # One agreement over the whole grid before the first all-to-all: a rank that disagrees or fails a
    # check raises the same error on every rank of the grid instead of leaving them in a collective.
    check_cp_inputs(q, k, v, mask, plan, None, groups=[uly_group, ring_group], world=r * u)
    g, uly_rank = mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses")
    hq, hkv = q.shape[1], k.shape[1]
    repeat = ulysses_heads(hq, hkv, u)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    ring_plan, sorts = group_plan(plan, r, u)
    order = sorts[g].to(q.device)
    qh, kh, vh = (seq_to_heads(t, uly_group).index_select(2, order) for t in (q, k, v))
    local_mask = _rank_mask(mask, uly_rank, u, hq, hkv, repeat)
    out = ring_attention(qh, kh, vh, local_mask, ring_plan, ring_group, scale=scale, impl=impl, stats=stats)
    return heads_to_seq(out.index_select(2, torch.argsort(order)), uly_group)
