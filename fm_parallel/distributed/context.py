"""One object that says how attention is parallelised, for integrations that call attention per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fm_parallel import backends
from fm_parallel.distributed.hybrid import hybrid_attention
from fm_parallel.distributed.prepared import PreparedMask, fail_together, local_prepare
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
        impl: the local kernel, resolved like ``flashmask_attention``'s (None = ``"auto"``).
        stats: accumulates the ring's transfer counts over calls.
        cuda_graphs: each step's ring layers captured once and replayed (``prepare(..., cuda_graphs=True)``,
            :mod:`fm_parallel.distributed.graphs`); ring mode on CUDA tensors over NCCL only.

    Per step the mask is prepared once (:class:`PreparedMask`). Pass :meth:`prepare`'s result to every
    layer (the trainer and the Hugging Face trainers do: nothing is looked up per layer); or pass the
    bare FlashMask: the first layer's call with a new FlashMask object prepares it, and every later
    layer, forward and backward, reuses it while :meth:`PreparedMask.made_from` says it is that mask
    (or its device copy), unedited. Every call agrees across ranks (one small all-gather): a rank
    whose call differs from its peers' (shapes, dtype, kernel, plan, mask) raises the same ValueError
    as they do, at whatever layer.
    """

    mode: str
    plan: ShardPlan
    group: object = None
    mesh: object = None
    impl: str | None = None
    stats: RingStats | None = None
    cuda_graphs: bool = False
    # The step's mask last prepared here, for callers that pass the same bare FlashMask to every layer.
    _step: PreparedMask | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in CP_MODES:
            raise ValueError(f"mode: expected one of {CP_MODES}, got {self.mode!r}")
        if not isinstance(self.plan, ShardPlan):
            raise ValueError(f"plan: expected a ShardPlan, got {type(self.plan).__name__}")
        if self.mode == "hybrid" and self.mesh is None:
            raise ValueError("mesh: expected a 2-D DeviceMesh ('ring', 'ulysses') for mode='hybrid', got None")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs: expected a bool, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.mode != "ring":
            raise ValueError(f"cuda_graphs: expected mode='ring' (Ulysses and hybrid run eagerly), got mode={self.mode!r}")
        if self.impl is not None and self.impl not in backends.names():  # the device decides the rest, per call
            raise ValueError(f"impl: expected one of {backends.names()}, got {self.impl!r}")

    def prepare(self, mask: FlashMask, device=None) -> PreparedMask:
        """The step's prepared mask (collective: every rank calls it). A mask on the host (where the
        loader built it) is moved to ``device`` once, and the diagonal chunk learns its document
        structure there without a device sync."""
        from fm_parallel.distributed.prepared import prepare

        # Kept as well, so a caller that prepares here but then passes the bare mask still reuses it.
        self._step = prepare(mask, self.plan, self.group, mesh=self.mesh if self.mode == "hybrid" else None, device=device,
                             cuda_graphs=self.cuda_graphs)
        return self._step

    @property
    def prepared(self) -> PreparedMask | None:
        """The PreparedMask last made by this context (by :meth:`prepare`, or by a call given a bare
        FlashMask), None before the first; the one a bare FlashMask call reuses when it was made from it."""
        return self._step

    def _prepared(self, q, k, v, mask) -> PreparedMask:
        """The prepared mask of ``mask``: the last one when it is the same object (or its device copy),
        unedited; else a new one for this call's tensors."""
        if isinstance(mask, PreparedMask):
            if self.cuda_graphs and mask.graphs is None:  # said, not raised: a rank alone must not leave the ring
                backends.log_once("context-graphs-unprepared",
                                  "fm_parallel: ContextParallel(cuda_graphs=True) was given a PreparedMask made without "
                                  "cuda_graphs; those layers run eagerly (prepare(..., cuda_graphs=True), or pass the "
                                  "FlashMask and let ContextParallel prepare it)")
            return mask
        if self._step is not None and self._step.made_from(mask):
            return self._step
        mesh = self.mesh if self.mode == "hybrid" else None
        # Prepared here on this rank alone (the loader's host mask moved to q's device once, CUDA graphs
        # set up), no collective: the attention call's agreement then checks it against the peers'. A
        # rank that re-prepares (its mask was edited, or is new to it alone) and peers that reuse
        # theirs thus meet in that one agreement instead of in different collectives.
        prepared, problem = local_prepare(q, mask, self.plan, self.group, mesh=mesh, cuda_graphs=self.cuda_graphs)
        if problem is not None:
            fail_together(q, k, v, mask, self.plan, self.group, mesh=mesh, problem=problem)
        self._step = prepared
        return prepared

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlashMask | PreparedMask,
                  scale=None) -> torch.Tensor:
        """``[B, H, N / P, D]`` local tensors in, this rank's ``[B, Hq, N / P, Dv]`` rows out."""
        prepared = self._prepared(q, k, v, mask)
        if self.mode == "ring":
            return ring_attention(q, k, v, prepared, self.plan, self.group, scale=scale, impl=self.impl, stats=self.stats)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, prepared, self.plan, self.group, scale=scale, impl=self.impl)
        return hybrid_attention(q, k, v, prepared, self.plan, self.mesh, scale=scale, impl=self.impl, stats=self.stats)
