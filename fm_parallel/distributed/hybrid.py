"""Hybrid context parallelism: Ulysses inside, ring outside, over a 2-D process grid.

The grid is a ``torch.distributed.device_mesh.DeviceMesh`` with dims ``("ring", "ulysses")``
(``ParallelDims.build_mesh()["ring", "ulysses"]``); context-parallel rank ``ring_idx * U + uly_idx``
holds ``plan.positions`` of that index. Inside a Ulysses group the all-to-all gathers the group's
tokens for ``H / U`` heads; across groups a ring with exact transfer skipping does the rest.
"""

from __future__ import annotations

import torch

from fm_parallel.distributed.prepared import PreparedMask, check_grid_mesh, for_call, prepare_agreed
from fm_parallel.distributed.ring import RingStats, ring_agreed
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.distributed.ulysses import heads_to_seq, rank_heads_mask, seq_to_heads, ulysses_heads
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["hybrid_attention", "group_plan"]


def group_plan(plan: ShardPlan, ring: int, ulysses: int) -> tuple[ShardPlan, list[torch.Tensor]]:
    """The ring's plan over Ulysses groups (each group's tokens, sorted), and per group the order
    that sorts the tokens as the all-to-all delivers them (member 0's, then member 1's...)."""
    merged = [torch.cat([plan.positions[g * ulysses + u] for u in range(ulysses)]) for g in range(ring)]
    sorts = [torch.sort(m) for m in merged]
    return ShardPlan([s.values for s in sorts], plan.num_tokens, plan.balance), [s.indices for s in sorts]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask | PreparedMask,
    plan: ShardPlan | None,
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
        mask: the step's :class:`PreparedMask` (``prepare(mask, plan, mesh=mesh)``, once per step),
            or the full FlashMask. plan: over ``R * U`` ranks (optional with a prepared mask).
        mesh: 2-D DeviceMesh with dims ``("ring", "ulysses")``.
        impl: the local kernel of the ring, resolved like ``flashmask_attention``'s.
        stats: the ring's transfer counts for this rank.
    Returns:
        ``[B, Hq, N / (R U), Dv]``. Differentiable.
    """
    check_grid_mesh(mesh)
    r, u = mesh["ring"].size(), mesh["ulysses"].size()
    # One agreement over the whole grid (Ulysses then ring groups) on every call, before
    # the first all-to-all: a rank that disagrees or fails a check raises the same error on every rank
    # of the grid instead of leaving them in a collective.
    prepared, _, _, name = for_call(q, k, v, mask, plan, mesh=mesh, impl=impl, chunked=True, scale=scale)
    ring_group, uly_group = mesh.get_group("ring"), mesh.get_group("ulysses")
    g, uly_rank = mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses")
    hq, hkv = q.shape[1], k.shape[1]
    repeat = ulysses_heads(hq, hkv, u)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)

    def inner():  # the ring over Ulysses groups, prepared once per step: its plan, mask head slice, orders
        ring_plan, sorts = group_plan(prepared.plan, r, u)
        # From the loader's host mask when there is one: the inner ring's diagonal chunk then learns
        # its document structure on the host.
        local_mask = rank_heads_mask(prepared.host_mask or prepared.mask, uly_rank, u, hq, hkv, repeat)
        order = sorts[g].to(q.device)
        return prepare_agreed(local_mask, ring_plan, ring_group, device=q.device), order, torch.argsort(order)

    ring_prepared, order, inverse = prepared.derived(("hybrid", hq, hkv, repeat, q.device), inner)
    qh, kh, vh = (seq_to_heads(t, uly_group).index_select(2, order) for t in (q, k, v))
    out = ring_agreed(qh, kh, vh, ring_prepared, ring_group, scale, name, stats)
    return heads_to_seq(out.index_select(2, inverse), uly_group)
