"""Ulysses context parallelism: all-to-all from sequence shards to head shards and back.

Each rank enters with its tokens (``plan.positions[rank]``) for all heads, ``[B, H, N / P, D]``, and
after one all-to-all holds every token for ``H / P`` heads, ``[B, H / P, N, D]``. The local kernel
then runs on the whole sequence with the full mask (only the rank's mask heads when the mask is per
head); the inverse all-to-all returns the output to sequence shards. Tokens arrive in the plan's
order (rank 0's, then rank 1's...); they are put in sequence order around the kernel so that its
launch plans stay contiguous and cached, whatever the balance mode.

GQA: when ``P > H_kv`` the K/V heads are replicated (each ``P / H_kv`` times) before the all-to-all so
every rank holds the one K/V head its query heads need; their gradients are summed back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fm_parallel import backends
from fm_parallel.attention import autocast_inputs
from fm_parallel.distributed import comm
from fm_parallel.distributed.comm import wait_with_deadline
from fm_parallel.distributed.prepared import PreparedMask, for_call
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ulysses_attention", "seq_to_heads", "heads_to_seq", "ulysses_heads", "rank_heads_mask"]


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single along dim 0 of a contiguous ``[P, ...]`` tensor."""
    x = x.contiguous()
    if dist.get_backend(group) == "gloo":  # a blocking host exchange anyway: give it the agreement's deadline
        # gloo moves host memory: GPU tensors travel through host copies (processes sharing one GPU,
        # tests/gpu/multi_gpu.py --shared-gpu); NCCL moves device memory directly.
        host = x.to("cpu")
        out = torch.empty(host.shape, dtype=host.dtype)  # not empty_like: that keeps x's strides
        wait_with_deadline([dist.all_to_all_single(out, host, group=group, async_op=True)], "Ulysses all-to-all",
                           comm.AGREEMENT_TIMEOUT_S)
        return out.to(x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    b, h, n, d = x.shape
    p = dist.get_world_size(group)
    parts = x.view(b, p, h // p, n, d).permute(1, 0, 2, 3, 4)  # [P (head group), B, H/P, n, D]
    got = _all_to_all(parts, group)  # [P (source rank), B, H/P, n, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * n, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    b, hp, total, d = x.shape
    p = dist.get_world_size(group)
    parts = x.view(b, hp, p, total // p, d).permute(2, 0, 1, 3, 4)  # [P (token owner), B, H/P, n, D]
    got = _all_to_all(parts, group)  # [P (head group), B, H/P, n, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, p * hp, total // p, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[B, H, N / P, D]`` (this rank's tokens, all heads) -> ``[B, H / P, N, D]`` (all tokens, plan order). Differentiable."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`. Differentiable."""
    return _HeadsToSeq.apply(x, group)


def ulysses_heads(h_q: int, h_kv: int, world: int) -> int:
    """How many times each K/V head is repeated so that ``world`` ranks can split the heads.

    Raises ValueError naming both numbers when the heads cannot be split.
    """
    if h_q % world:
        raise ValueError(f"q: expected a number of heads divisible by the Ulysses degree {world}, got {h_q} heads")
    if h_kv % world == 0:
        return 1
    if world % h_kv == 0:
        return world // h_kv
    raise ValueError(
        f"k: expected K/V heads divisible by the Ulysses degree {world}, or dividing it (then replicated), got {h_kv} heads"
    )


def rank_heads_mask(mask: FlashMask, rank: int, world: int, h_q: int, h_kv: int, repeat: int) -> FlashMask:
    """The mask heads of this rank's head slice (all of them when the mask is shared by heads)."""
    if mask.heads == 1:
        return mask
    if mask.heads == h_q and h_q != h_kv:
        per = h_q // world
    else:  # one mask head per K/V head; after replication each rank holds (h_kv * repeat) / world of them
        per = h_kv * repeat // world
        if repeat > 1:
            idx = torch.arange(rank * per, (rank + 1) * per, device=mask.device) // repeat
            return FlashMask(mask.fms.index_select(1, idx), mask.fme.index_select(1, idx), mask.num_rows, validate=False)
    sl = slice(rank * per, (rank + 1) * per)
    return FlashMask(mask.fms[:, sl], mask.fme[:, sl], mask.num_rows, validate=False)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask | PreparedMask,
    plan: ShardPlan | None = None,
    group=None,
    *,
    scale: float | None = None,
    impl: str | None = "auto",
) -> torch.Tensor:
    """FlashMask attention over a context-parallel group by head all-to-all (DeepSpeed-Ulysses style).

    Args:
        q: ``[B, Hq, N / P, D]``; k, v: ``[B, Hkv, N / P, D]``: this rank's tokens in the order of
            ``plan.positions[rank]``. ``Hq`` must divide by P; ``Hkv`` must divide by P or divide P.
        mask: the step's :class:`PreparedMask` (made once per step, reused by every layer), or the
            full FlashMask, the same on every rank. plan: the same on every rank (optional with a
            prepared mask).
        impl: the local kernel, resolved like ``flashmask_attention``'s (``"auto"`` / None,
            ``"cute"``, ``"triton"``, ``"torch"``, ``"dense"``).
    Returns:
        ``[B, Hq, N / P, Dv]``, this rank's rows. Differentiable.
    Raises:
        ValueError: as :func:`~fm_parallel.distributed.ring_attention`, on every rank.
    """
    # Every call agrees (the kernel name resolved inside, before the all-to-all): a rank that alone
    # brings other shapes, another kernel or another plan fails on every rank.
    prepared, world, rank, impl = for_call(q, k, v, mask, plan, group, impl=impl, scale=scale)
    hq, hkv = q.shape[1], k.shape[1]
    repeat = ulysses_heads(hq, hkv, world)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    qh, kh, vh = (seq_to_heads(t, group) for t in (q, k, v))
    # Sequence order around the kernel: contiguous rows, so its plans are simple and cached (on the
    # prepared mask's head slice, made once per step).
    order, inverse = prepared.derived(("ulysses order", q.device), lambda: _orders(prepared.plan, q.device))
    local_mask = prepared.derived(("ulysses mask", rank, world, hq, hkv, repeat),
                                  lambda: rank_heads_mask(prepared.mask, rank, world, hq, hkv, repeat))
    qs, ks, vs = autocast_inputs(*(t.index_select(2, inverse) for t in (qh, kh, vh)))
    # The kernel the agreement resolved, called as the ring calls it (no second resolution or check):
    # all rows of the sequence, consecutive from 0, for this rank's heads.
    rows = prepared.derived(("ulysses rows", qs.shape[2], q.device), lambda: torch.arange(qs.shape[2], device=q.device))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, _ = backends.get(impl).attention(qs, ks, vs, local_mask, rows, scale, 0, False)
    return heads_to_seq(out.index_select(2, order), group)


def _orders(plan: ShardPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's token order (rank 0's tokens, then rank 1's...) and its inverse, on ``device``."""
    order = torch.cat(plan.positions).to(device)
    return order, torch.argsort(order)
