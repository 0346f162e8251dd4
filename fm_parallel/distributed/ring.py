"""Ring attention for any FlashMask, with transfers skipped exactly where no visible pair needs them.

Every rank holds the tokens listed by a :class:`ShardPlan` and the full O(N) mask. From the mask
and the plan all ranks compute the same exact table of visible pairs between rank r's queries and
rank j's keys (:func:`pair_counts`); in step ``s`` rank r receives the K/V chunk of ``r - s`` only if
its entry is non-zero, and that rank sends it only then. The local kernel runs per received chunk
with the queries' global rows and the chunk's mask columns; partial results merge through the
log-sum-exp. The next step's receive is posted before the current chunk is computed.

Backward (own autograd, like ring-flash-attn): K/V travel again, each rank computes dQ locally and
the dK/dV of every chunk it used, and sends those back to the chunk's owner, again only where the
table says the pair exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fm_parallel import launchers
from fm_parallel.distributed.comm import RingComm, check_cp_inputs
from fm_parallel.distributed.merge import merge
from fm_parallel.distributed.sharding import ShardPlan, pair_counts
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ring_attention", "RingStats"]


@dataclass
class RingStats:
    """What one call did on this rank (forward and backward together)."""

    transfers_posted: int = 0  # chunks this rank sent (K/V forward, K/V and dK/dV backward)
    transfers_skipped: int = 0  # chunks a plain ring would have sent that this rank did not
    bytes_sent: int = 0
    visible_pairs: int = 0  # (query, key) pairs of this rank's queries, per mask row


def _pair_table(mask: FlashMask, plan: ShardPlan) -> torch.Tensor:
    key = ("pairs", mask.digest(), tuple(mask.fms.shape))
    if key not in plan._cache:
        plan._cache[key] = pair_counts(mask, plan.positions)
    return plan._cache[key]


class _Ring:
    """State shared by the forward and backward of one call."""

    def __init__(self, mask, plan, group, scale, impl, table, stats):
        self.comm = RingComm(group)
        self.mask, self.plan, self.scale, self.impl, self.stats = mask, plan, scale, impl, stats
        self.needed = (table > 0).tolist()  # needed[r][j]: rank r's queries see rank j's keys
        self.rank, self.world = self.comm.rank, self.comm.world_size
        # A contiguous shard's rows are q_offset + arange: the kernels then build consecutive-row plans
        # and cache them on the column masks, which are kept for the backward of the same call.
        self.q_offset = int(plan.positions[self.rank][0]) if plan.balance == "contiguous" else None
        self._columns: dict[int, FlashMask] = {}

    def positions(self, rank: int, device) -> torch.Tensor:
        return self.plan.positions[rank].to(device)

    def columns(self, rank: int, device) -> FlashMask:
        """The mask's columns of ``rank``'s keys (the same object in the forward and the backward)."""
        if rank not in self._columns:
            self._columns[rank] = self.mask.select_keys(self.positions(rank, device))
        return self._columns[rank]

    def post_kv(self, step: int, k: torch.Tensor, v: torch.Tensor):
        """Send my K/V to ``rank + step`` if it needs them; receive ``rank - step``'s if I do."""
        dst, src = self.comm.send_to(step), self.comm.recv_from(step)
        sends = [(k, dst), (v, dst)] if self.needed[dst][self.rank] else []
        bufs = (torch.empty_like(k), torch.empty_like(v)) if self.needed[self.rank][src] else None
        recvs = [(bufs[0], src), (bufs[1], src)] if bufs else []
        self._count(sends, skipped=0 if sends else 1)
        return self.comm.exchange(sends, recvs), bufs

    def kv_chunks(self, k: torch.Tensor, v: torch.Tensor):
        """Yield ``(step, source rank, (k, v) or None)`` for every step, my own chunk first.

        The transfer of step s + 1 is posted before step s's chunk is handed out (and so before it
        is computed), overlapping communication with the local kernel.
        """
        pending = self.post_kv(1, k, v) if self.world > 1 else None
        for step in range(self.world):
            if step == 0:
                chunk = (k, v) if self.needed[self.rank][self.rank] else None
            else:
                reqs, chunk = pending
                pending = self.post_kv(step + 1, k, v) if step + 1 < self.world else None
                self.comm.wait(reqs)
            yield step, self.comm.recv_from(step), chunk

    def _count(self, sends, skipped: int) -> None:
        if self.stats is None:
            return
        self.stats.transfers_posted += 1 if sends else 0
        self.stats.transfers_skipped += skipped
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        device = q.device
        pos = ring.positions(ring.rank, device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=acc, device=device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=device)
        for _, src, chunk in ring.kv_chunks(k, v):
            if chunk is None:
                continue
            o, l = launchers.forward(q, chunk[0], chunk[1], ring.columns(src, device), pos, ring.scale, ring.impl,
                                     q_offset=ring.q_offset)
            out, lse = merge(out, lse, o, l)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        device, me = q.device, ring.rank
        pos = ring.positions(me, device)
        dout = dout.contiguous()
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq = torch.zeros(q.shape, dtype=acc, device=device)
        dk, dv = torch.zeros(k.shape, dtype=acc, device=device), torch.zeros(v.shape, dtype=acc, device=device)
        grads_in_flight = []  # (requests, received dK, received dV)
        for step, src, chunk in ring.kv_chunks(k, v):
            dst = ring.comm.send_to(step)
            part = None
            if chunk is not None:
                dq_s, dk_s, dv_s = launchers.backward(
                    q, chunk[0], chunk[1], out, lse.float() if lse.dtype != torch.float64 else lse, dout,
                    ring.columns(src, device), pos, ring.scale, ring.impl, q_offset=ring.q_offset,
                )
                dq += dq_s
                part = (dk_s.contiguous(), dv_s.contiguous())
            if step == 0:
                if part is not None:
                    dk += part[0]
                    dv += part[1]
                continue
            # Return the chunk's gradients to its owner; collect mine from the ranks that used my keys.
            sends = [(part[0], src), (part[1], src)] if part is not None else []
            bufs = (torch.empty_like(k), torch.empty_like(v)) if ring.needed[dst][me] else None
            recvs = [(bufs[0], dst), (bufs[1], dst)] if bufs else []
            ring._count(sends, skipped=0 if sends else 1)
            grads_in_flight.append((ring.comm.exchange(sends, recvs), bufs, part))
        for reqs, bufs, _ in grads_in_flight:
            ring.comm.wait(reqs)
            if bufs is not None:
                dk += bufs[0]
                dv += bufs[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask,
    plan: ShardPlan,
    group=None,
    *,
    scale: float | None = None,
    impl: str | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """FlashMask attention over a context-parallel group, ring schedule with exact transfer skipping.

    Args:
        q: ``[B, Hq, N / P, D]``, this rank's queries in the order of ``plan.positions[rank]``;
            k, v: ``[B, Hkv, N / P, D | Dv]`` likewise.
        mask: the full mask (``N`` key columns, global rows), the same on every rank.
        plan: from :func:`fm_parallel.distributed.shard`, the same on every rank.
        group: the context-parallel process group (default: the world).
        impl: local kernel, ``"cute"`` (Hopper, the [cute] extra), ``"triton"`` or ``"torch"`` (default: Triton on
            CUDA, else PyTorch).
        stats: filled with this rank's transfers posted and skipped, bytes sent and visible pairs.
    Returns:
        ``[B, Hq, N / P, Dv]``: this rank's rows of the attention output. Differentiable.
    Raises:
        ValueError: bad shapes, or ranks that disagree on shapes, plan or mask (raised on every rank).
    """
    world, rank = check_cp_inputs(q, k, v, mask, plan, group)
    d = q.shape[-1]
    table = _pair_table(mask, plan)
    if stats is not None:
        stats.visible_pairs += int(table[rank].sum())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ring = _Ring(mask, plan, group, scale, launchers.resolve(impl, q.device), table, stats)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring)
