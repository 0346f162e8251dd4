"""Where a rank sits in ``world = dp x cp``, and one row sharded into what that rank computes on.

The one context-parallel layout of both front doors: the trainer (``fm_parallel.trainer.parallel``
checks its config keys, then builds a :class:`CPLayout`) and the Hugging Face trainers
(``fm_parallel.integrations.context_parallel``, from a ``ContextParallelConfig``). It owns the mesh
and its groups, the row's :class:`ContextParallel`, the differentiable sum over a CP group and the
sharding of a row (padding it to what the plan needs, preparing its mask once)::

    lay = CPLayout("ring", degree=2, balance="zigzag")        # over the current process group
    shard = lay.shard_row(mask, {"input_ids": ids, "labels": labels, "positions": pos}, device)
    model(shard.tensors["input_ids"], ..., flashmask=shard.mask, fm_context=shard.ctx)
    loss = lay.cp_sum(local_sum) / count                       # the row's, on every rank of the group

Ranks: mesh dims ``("dp", "ring", "ulysses")`` row-major (Ulysses innermost, on the fastest links), so
``dp_rank = rank // degree`` and ``cp_rank = rank % degree`` (the plan's rank). Data parallelism runs
across CP groups: data-parallel rank ``d`` takes rows ``d, d + dp, ...`` and every rank of its group
holds the same row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fm_parallel.distributed.context import CP_MODES, ContextParallel
from fm_parallel.distributed.dims import ParallelDims
from fm_parallel.distributed.prepared import PreparedMask
from fm_parallel.distributed.sharding import BALANCE_MODES, ShardPlan, length_multiple, shard
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["CPLayout", "ShardedRow", "LAYOUT_MODES", "ROW_PADDING", "pad_mask"]

LAYOUT_MODES = CP_MODES + ("none",)

# What each per-token field of a row holds where the row is padded to the plan's length multiple:
# padding is its own documents (a token that sees only itself), never a target, in no sample.
ROW_PADDING = {"input_ids": 0, "labels": -100, "positions": "arange", "segment": -1, "sample": -1}


def pad_mask(mask: FlashMask, n: int) -> FlashMask:
    """``mask`` over ``n >= mask.num_rows`` tokens; each added token sees only itself (a document of
    its own, so no real row sees it and its own row is not empty)."""
    b, h, old, m = mask.fms.shape
    if n == old:
        return mask
    cols = torch.arange(old, n, dtype=torch.int32, device=mask.device).view(1, 1, -1, 1).expand(b, h, -1, 1)
    fms = torch.cat([cols, torch.full((b, h, n - old, m - 1), n, dtype=torch.int32, device=mask.device)], -1)
    fme = torch.cat([cols, torch.full((b, h, n - old, m - 1), -1, dtype=torch.int32, device=mask.device)], -1)
    return FlashMask(torch.cat([mask.fms, fms], 2), torch.cat([mask.fme, fme], 2), n, validate=False)


@dataclass
class ShardedRow:
    """One row as this rank computes on it. ``tensors``: the row's ``[B, n]`` fields on the device
    (``n = N' / cp`` under CP, ``N'`` the row padded to the plan's multiple; the whole row without CP).
    ``mask``: the step's :class:`PreparedMask` under CP (pass it to every layer as it is: forward and
    backward reuse it), else the row's FlashMask on the device. ``ctx``: the row's ContextParallel
    (None without CP). ``plan``: its ShardPlan (None without CP)."""

    tensors: dict
    mask: PreparedMask | FlashMask
    ctx: ContextParallel | None
    plan: ShardPlan | None


class _GroupSum(torch.autograd.Function):
    """``all_reduce(SUM)`` over ``group`` whose backward is the same sum of the gradients: what
    ``torch.distributed.nn.functional.all_reduce`` did, which torch 2.13 deprecates (a warning per
    rank in every run) with no differentiable replacement in ``_functional_collectives``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CPLayout:
    """Where this rank sits, over the current process group (one process without one).

    Args:
        mode: ``"ring"``, ``"ulysses"``, ``"hybrid"`` (Ulysses inside, ring outside) or ``"none"``.
        degree: ranks per CP group (1, or ``mode="none"``: no CP, the same code on every rank).
        ulysses: hybrid only: the Ulysses ranks inside a group (a divisor of ``degree``).
        balance: :func:`fm_parallel.distributed.shard`'s ``"contiguous"``, ``"zigzag"`` or ``"mask"``.
        impl: the local kernel (None: ``"auto"``).
        cuda_graphs: ring on CUDA over NCCL: each step's ring layers captured once and replayed.

    The front doors check their own keys first (naming them); what reaches here wrong raises ValueError.
    """

    def __init__(self, mode: str, degree: int = 1, ulysses: int = 1, balance: str = "contiguous",
                 impl: str | None = None, cuda_graphs: bool = False):
        if mode not in LAYOUT_MODES:
            raise ValueError(f"mode: expected one of {LAYOUT_MODES}, got {mode!r}")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance: expected one of {BALANCE_MODES}, got {balance!r}")
        degree = 1 if mode == "none" else degree
        ulysses = {"ring": 1, "ulysses": degree, "hybrid": ulysses, "none": 1}[mode]
        if not isinstance(degree, int) or degree < 1 or not isinstance(ulysses, int) or ulysses < 1 or degree % ulysses:
            raise ValueError(f"degree: expected an int >= 1 that ulysses = {ulysses!r} divides, got {degree!r}")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world % degree:
            raise ValueError(f"degree: expected a divisor of the {self.world} ranks, got {degree}")
        self.mode, self.balance, self.impl, self.cuda_graphs = mode, balance, impl, cuda_graphs
        self.dims = ParallelDims(self.world, ring=degree // ulysses, ulysses=ulysses)
        self.dp_rank, self.cp_rank = self.rank // degree, self.rank % degree
        self.mesh = self.group = None
        self.groups: list = []  # what a sum over the group runs over, in order (hybrid: Ulysses, then ring)
        if degree > 1:
            # Groups of their own (not the world's): the data-parallel gradient all-reduce and the CP
            # collectives never share one.
            mesh = self.dims.build_mesh("cuda" if torch.cuda.is_available() else "cpu")
            if mode == "hybrid":
                self.mesh = mesh["ring", "ulysses"]
                self.groups = [self.mesh.get_group("ulysses"), self.mesh.get_group("ring")]
            else:
                self.group = mesh["ulysses" if mode == "ulysses" else "ring"].get_group()
                self.groups = [self.group]

    @property
    def cp(self) -> int:
        """Ranks per CP group (1: no CP)."""
        return self.dims.cp

    @property
    def dp(self) -> int:
        """Data-parallel groups."""
        return self.dims.dp

    def __repr__(self) -> str:
        return f"CPLayout({self.mode} x{self.cp}, dp {self.dp}, rank {self.rank}: dp_rank {self.dp_rank}, cp_rank {self.cp_rank})"

    def context(self, plan: ShardPlan) -> ContextParallel:
        """The row's :class:`ContextParallel` (a new one per row: its plan is the row's)."""
        hybrid = self.mode == "hybrid"
        return ContextParallel(self.mode, plan, group=None if hybrid else self.group, mesh=self.mesh if hybrid else None,
                               impl=self.impl, cuda_graphs=self.cuda_graphs)

    def cp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over this rank's CP group, differentiable: each rank's gradient is the sum's, so
        with the result replicated on the group, a mean over the world gives the one-process gradient
        of whatever the group computes from it."""
        for group in self.groups:
            x = _GroupSum.apply(x, group)
        return x

    def shard_row(self, mask: FlashMask, tensors: dict, device: torch.device) -> ShardedRow:
        """Shard one row: ``tensors`` its ``[B, N]`` per-token fields (names from :data:`ROW_PADDING`;
        None values pass through), ``mask`` its FlashMask over ``N``. Under CP the row is padded to the
        plan's length multiple (:data:`ROW_PADDING`), planned (``balance``), its mask prepared once on
        ``device`` (one collective over the group) and each field cut to this rank's shard. Without CP
        the fields and the mask move to ``device``."""
        unknown = sorted(set(tensors) - set(ROW_PADDING))
        if unknown:
            raise ValueError(f"tensors: expected fields among {sorted(ROW_PADDING)}, got {unknown}")
        moved = {k: None if t is None else t.to(device) for k, t in tensors.items()}
        if self.cp == 1:
            return ShardedRow(moved, mask.to(device), None, None)
        n = mask.num_rows
        pad = -n % length_multiple(self.cp, self.balance)
        if pad:
            for name, t in moved.items():
                if t is None:
                    continue
                fill = ROW_PADDING[name]
                extra = (torch.arange(pad, device=device, dtype=t.dtype).expand(t.shape[0], pad) if fill == "arange"
                         else torch.full((t.shape[0], pad), fill, device=device, dtype=t.dtype))
                moved[name] = torch.cat([t, extra], 1)
            mask = pad_mask(mask, n + pad)
        plan = shard(mask, self.cp, self.balance)
        ctx = self.context(plan)
        # The row's mask prepared once from the host mask (its digest, the ranks' agreement, the pair
        # table, column masks); every layer of every pass, forward and backward, reuses it.
        prepared = ctx.prepare(mask, device=device)
        part = {k: None if t is None else plan.shard(t, self.cp_rank, dim=1) for k, t in moved.items()}
        return ShardedRow(part, prepared, ctx, plan)
