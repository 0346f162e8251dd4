"""Change 2 to FA4's SM90 kernels (:mod:`.patches`): the CTAs of a FlashMask kernel run heaviest
block first, in the order :func:`.sparsity.cost_order` writes into the ``mask_mod``'s last auxiliary
tensor (the reasons and the measurements: :mod:`.patches`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.cutlass_dsl import min as dsl_min
from quack.cute_dsl_utils import ParamsBase

from fm_parallel.kernels.fa4.sparsity import BLOCK_Q
from fm_parallel.kernels.fa4.spec import spec_of, traced
from fm_parallel.kernels.plan import ORDER_BUCKETS

__all__ = ["CostOrderScheduler", "scheduler_proxy"]


class CostOrderScheduler:
    """FA4 tile scheduler (the ``SingleTileScheduler`` protocol: one work item per CTA) running the
    blocks in the order of :func:`.sparsity.cost_order`: bucket by bucket (heaviest first), every
    (head, batch) entry of the kernel in turn over the bucket's blocks. Each block of the lists covers
    ``rep`` of the kernel's blocks (64-row forward tiles or PackGQA's packed rows under 128-row
    lists; else 1). The order names list blocks only, so it holds whatever heads the kernel packs.
    Blocks past the kernel's count (a ragged last list block split) are CTAs with nothing to do.
    :func:`fm_parallel.kernels.plan.launch_items` is this decoding in Python. (Its protocol methods mirror FA4's
    ``SingleTileLPTBwdScheduler``; not a subclass of it, so that importing this module never depends
    on FA4's internals before :func:`install` has checked the version.)"""

    @dataclass
    class Params(ParamsBase):
        total: Int32  # CTAs: T * group
        num_blocks: Int32  # T: list blocks
        num_block: Int32  # the kernel's blocks per (head, batch)
        group: Int32  # CTAs per list block: num_head * num_batch * rep
        num_head_divmod: FastDivmodDivisorV2
        order: cute.Tensor
        rep: cutlass.Constexpr[int] = 1

        @staticmethod
        def create(args, order: cute.Tensor, rep: int) -> "CostOrderScheduler.Params":
            blocks = (args.num_block + (rep - 1)) // rep
            group = args.num_head * args.num_batch * rep
            return CostOrderScheduler.Params(blocks * group, blocks, args.num_block, group,
                                             FastDivmodDivisorV2(args.num_head), order, rep)

    def __init__(self, params: Params, tile_idx: Int32, *, loc=None, ip=None):
        self.params = params
        self._tile_idx = tile_idx
        self._loc = loc
        self._ip = ip

    @staticmethod
    def create(params: Params, ctx=None, *, loc=None, ip=None) -> "CostOrderScheduler":
        return CostOrderScheduler(params, cute.arch.block_idx()[0], loc=loc, ip=ip)

    @staticmethod
    def get_grid_shape(params: Params, *, loc=None, ip=None):
        return (params.total, Int32(1), Int32(1))

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None):
        from flash_attn.cute.tile_scheduler import WorkTileInfo

        params = self.params
        order = params.order
        starts = params.num_blocks  # order[starts + r]: where bucket rank r begins in order[:T]
        # advance_to_next_work sets the index past the end: decode a valid one, report no work
        cta = dsl_min(self._tile_idx, params.total - 1)
        bucket = Int32(0)
        for r in cutlass.range_constexpr(1, ORDER_BUCKETS):  # the last bucket starting at or before cta
            bucket = Int32(r) if cta >= Int32(order[starts + r]) * params.group else bucket
        first = Int32(order[starts + bucket])
        span = (Int32(order[starts + bucket + 1]) - first) * params.rep  # > 0: cta lies in this bucket
        entry = (cta - first * params.group) // span
        rest = cta - first * params.group - entry * span
        sub = Int32(0)
        rank = rest
        if const_expr(params.rep > 1):
            rank = rest // params.rep
            sub = rest - rank * params.rep
        block = Int32(order[first + rank]) * params.rep + sub
        batch_idx, head_idx = divmod(entry, params.num_head_divmod)
        is_valid = (self._tile_idx < params.total) & (block < params.num_block)
        return WorkTileInfo((Int32(block), Int32(head_idx), Int32(batch_idx), Int32(0)), is_valid)

    def initial_work_tile_info(self, *, loc=None, ip=None):
        return self.get_current_work(loc=loc, ip=ip)

    def prefetch_next_work(self, *, loc=None, ip=None):
        pass

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._tile_idx = self.params.total  # one item per CTA
        return self.get_current_work()

    def producer_tail(self, *, loc=None, ip=None):
        pass

    def __extract_mlir_values__(self):
        values, self._values_pos = [], []
        for obj in [self.params, self._tile_idx]:
            obj_values = cutlass.extract_mlir_values(obj)
            values += obj_values
            self._values_pos.append(len(obj_values))
        return values

    def __new_from_mlir_values__(self, values):
        obj_list = []
        for obj, n_items in zip([self.params, self._tile_idx], self._values_pos):
            obj_list.append(cutlass.new_from_mlir_values(obj, values[:n_items]))
            values = values[n_items:]
        return self.__class__(*obj_list, loc=self._loc)


def _traced_kernel():
    """(spec, auxiliary tensors) of the FA4 kernel whose ``__call__`` is being traced, read from the
    calling frames (the scheduler is chosen inside ``__call__``, which holds ``self`` and ``aux_data``);
    (None, None) for a kernel without one of our ``mask_mod`` functions."""
    frame = sys._getframe(2)
    for _ in range(4):  # __call__ is the scheduler's direct caller; a little slack for DSL wrappers
        if frame is None:
            break
        local = frame.f_locals
        if "aux_data" in local and hasattr(local.get("self"), "mask_mod"):
            spec = spec_of(local["self"].mask_mod)
            return (spec, local["aux_data"].tensors) if spec is not None else (None, None)
        frame = frame.f_back
    return None, None


def scheduler_proxy(plain, lpt, backward: bool):
    """A stand-in for a kernel module's ``SingleTileScheduler`` (used by FA4 for the block-sparse
    path): for our kernels, the schedule their :class:`Options` ask for; FA4's own otherwise. Later
    calls dispatch on the parameters' type, which records the choice."""
    suffix = "_bwd" if backward else ""
    schedulers = (plain, lpt, CostOrderScheduler)

    class ScheduleProxy:
        @staticmethod
        def to_underlying_arguments(args, *a, **kw):
            spec, aux = _traced_kernel()
            schedule = spec.options.schedule if spec is not None else "grid"
            if schedule == "cost":
                expected = 2 + int(spec.explicit_rows)  # bounds, [rows,] order
                # list blocks per kernel block: the backward's key tile is the lists' key block (FA4
                # requires it); the forward's tile holds tile_m packed rows of qpk heads
                rows = 1 if backward else BLOCK_Q * args.qhead_per_kvhead_packgqa
                tile = 1 if backward else args.tile_shape_mn[0]
                if aux is not None and len(aux) == expected and rows % tile == 0:
                    traced["cost_order" + suffix] += 1
                    return CostOrderScheduler.Params.create(args, aux[-1], rows // tile)
                traced["cost_order_unavailable" + suffix] += 1  # no order passed, or tiles that split no list block
                schedule = "reversed"
            if schedule == "reversed" and not backward:
                traced["reversed_order"] += 1
                return lpt.to_underlying_arguments(dataclasses.replace(args, lpt=True), *a, **kw)
            traced["grid_order" + suffix] += 1
            return plain.to_underlying_arguments(args, *a, **kw)

        @staticmethod
        def _cls(params):
            return next(s for s in schedulers if isinstance(params, s.Params))

        @staticmethod
        def get_grid_shape(params, *a, **kw):
            return ScheduleProxy._cls(params).get_grid_shape(params, *a, **kw)

        @staticmethod
        def create(params, *a, **kw):
            return ScheduleProxy._cls(params).create(params, *a, **kw)

    return ScheduleProxy
