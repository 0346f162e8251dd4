"""Two changes to FlashAttention-4's SM90 kernels, made only for FlashMask's own ``mask_mod``.

FA4 (pinned ``flash-attn-4==4.0.0b36``) treats a ``mask_mod`` as an opaque per-score predicate, and
schedules every block-sparse kernel in plain grid order. Both cost FlashMask speed that its column
bounds make easy to win back, so this module replaces trace-time pieces of FA4, and only when the
kernel being traced carries one of our ``mask_mod`` functions (:func:`register`); Flex, plain FA4 and
every other caller trace FA4's untouched code.

1. **Column-first masking** (``AttentionMask.apply_mask``). FA4 calls the ``mask_mod`` for each score a
   thread holds, and each call loads the column's bounds again (the compiler does not merge loads
   across the unrolled calls, checked in the PTX). FlashMask's predicate depends on the row only
   through a comparison, so here each thread loads the bounds once per *column* it holds and compares
   every row against them: the forward's 2 rows x 32 columns per thread need 32 loads instead of 64,
   the backward (scores transposed, many rows per column) a few instead of 64. Partial tiles are a
   quarter to a third of the visited tiles on packed documents and sliding windows.
2. **Heaviest-first schedule** (the ``SingleTileScheduler`` of the forward and the backward). FA4 runs
   the block-sparse path in grid order, one CTA per (block, head, batch); a block that visits many
   more tiles than the others (the query block of global rows, the key block of attention sinks, the
   last rows of causal-like masks) may then start late and run alone at the end: up to 1.5x the
   kernel's ideal time on windows with sinks or global tokens (launch/bench/schedule_model.py at e941a68), and
   measured on the H200: a 1.36-1.55x slower backward on sliding windows with sinks. FA4's causal answer,
   reversing the query blocks (its LPT scheduler), only helps masks whose heavy blocks are the last
   ones. Here the CTAs run in an order given at run time (:class:`CostOrderScheduler`): blocks in
   buckets of visited tiles, heaviest bucket first, each bucket run head by head
   (:func:`.fa4_sparsity.cost_order`, from the same block lists), so any mask's heavy blocks start
   early while the CTAs in flight share one or two heads' data in L2 (sorting every (block, head)
   item by cost with heads interleaved lost 10% on the DPO backward to L2 misses). The order tensor
   is the last of the ``mask_mod``'s auxiliary tensors. Which tile runs where changes no result.

Both are switched per ``mask_mod`` (:class:`Options`), so a benchmark can compare them in one process
(the options are part of the ``mask_mod``'s compile-cache hash). :func:`install` is idempotent and
refuses any FA4 version other than the pinned one, leaving FA4 unchanged (the backend still works,
without these gains; a warning says so).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute import FastDivmodDivisorV2
from cutlass.cutlass_dsl import min as dsl_min
from quack.cute_dsl_utils import ParamsBase

from .fa4_sparsity import BLOCK_Q
from .plan import ORDER_BUCKETS

__all__ = ["SCHEDULES", "CostOrderScheduler", "FlashMaskSpec", "Options", "install", "register",
           "traced"]

log = logging.getLogger(__name__)

PINNED_FA4 = "4.0.0b36"


# How the CTAs of a FlashMask kernel are ordered: "cost" (heaviest first from the block lists, both
# passes), "reversed" (FA4's LPT scheduler on the forward: query blocks in reverse; the backward in grid
# order; what this module did before "cost"), "grid" (FA4's own order).
SCHEDULES = ("cost", "reversed", "grid")


@dataclass(frozen=True)
class Options:
    """Which changes a ``mask_mod`` gets (both by default): column-first masking, and the schedule."""

    column_first: bool = True
    schedule: str = "cost"

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")


@dataclass(frozen=True)
class FlashMaskSpec:
    """What the column-first masking must know about a FlashMask ``mask_mod`` (its shape class)."""

    batch_broadcast: bool  # Bm == 1: row 0 of the bounds serves every batch entry
    q_per_mask_head: int  # query heads per mask head
    intervals: int  # M, 1..4
    explicit_rows: bool  # rows read from aux_tensors[1]; else the local query index is the row
    options: Options = Options()


_SPECS: dict[int, tuple[object, FlashMaskSpec]] = {}  # id(mask_mod) -> (mask_mod kept alive, spec)
# What kernels were traced with, counted at trace time (never at run time): "column_first" /
# "per_score" masking of FlashMask partial tiles, with "_transposed" for the backward's S^T layout,
# and the schedules: "cost_order" / "reversed_order" / "grid_order" (forward), the same with "_bwd"
# (backward; "reversed" leaves it in grid order). For tests and the compile check.
traced: collections.Counter = collections.Counter()


def register(mask_mod, spec: FlashMaskSpec) -> None:
    """Mark ``mask_mod`` as FlashMask's: kernels traced with it get the changes ``spec.options`` asks for."""
    _SPECS[id(mask_mod)] = (mask_mod, spec)


def _spec_of(mask_mod) -> FlashMaskSpec | None:
    entry = _SPECS.get(id(mask_mod)) if mask_mod is not None else None
    return entry[1] if entry is not None and entry[0] is mask_mod else None


@cute.jit
def _apply_flashmask(mask, acc_S: cute.Tensor, batch_idx: Int32, head_idx: Int32, m_block: Int32, n_block: Int32,
                     thr_mma: cute.TiledMma, mask_seqlen: cutlass.Constexpr[bool], aux_tensors,
                     spec: cutlass.Constexpr):
    """FA4's ``AttentionMask.apply_mask`` for a FlashMask ``mask_mod`` (same coordinates, swap_AB
    included): per column the bounds ``[Bm, Hm, Nk, M]`` int64 (``pack_bounds``) are loaded once,
    then each row of the thread is compared. Scores outside the sequences are masked like FA4 does
    when ``mask_seqlen``; the bounds are read at a clamped column there (never out of bounds)."""
    from quack import layout_utils

    acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S, transpose=mask.swap_AB)
    acc_shape = (mask.tile_m, mask.tile_n)
    cS = cute.make_identity_tensor(acc_shape if const_expr(not mask.swap_AB) else acc_shape[::-1])
    tScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cS), transpose=mask.swap_AB)
    t0ScS_mn = layout_utils.reshape_acc_to_mn(thr_mma.get_slice(0).partition_C(cS), transpose=mask.swap_AB)
    ROW = 0 if const_expr(not mask.swap_AB) else 1
    COL = 1 if const_expr(not mask.swap_AB) else 0
    nrow = const_expr(cute.size(tScS_mn.shape[0]))
    ncol = const_expr(cute.size(tScS_mn.shape[1]))
    thr_col_offset = tScS_mn[0][COL]
    col_base = thr_col_offset + n_block * mask.tile_n
    bounds = aux_tensors[0]
    b = batch_idx * (0 if const_expr(spec.batch_broadcast) else 1)
    # Under PackGQA (forward, GQA) the tile's rows interleave the qpk query heads of KV head head_idx:
    # packed row p is row p // qpk of query head head_idx * qpk + p % qpk. Callers make sure those
    # heads share one mask head (q_per_mask_head a multiple of qpk), so the column loads stay per column.
    qpk = mask.qhead_per_kvhead_packgqa
    h = (head_idx * qpk) // spec.q_per_mask_head

    # Each thread's rows, once: the index in the sequence (for its end) and the FlashMask row
    # (consecutive: the same, the bounds being shifted by the row offset; explicit: aux_tensors[1]).
    # (comprehensions are plain Python at trace time: unrolled like range_constexpr)
    local_rows = [tScS_mn[r, 0][ROW] + m_block * mask.tile_m for r in range(nrow)]
    if const_expr(qpk != 1):
        local_rows = [row // qpk for row in local_rows]
    rows = local_rows
    if const_expr(spec.explicit_rows):
        rows = [aux_tensors[1][dsl_min(local_rows[r], mask.seqlen_q - 1)] for r in range(nrow)]

    for col in cutlass.range_constexpr(ncol):
        kv = col_base + t0ScS_mn[0, col][COL]
        kv_load = kv
        if const_expr(mask_seqlen):
            kv_load = dsl_min(kv, mask.seqlen_k - 1)
        firsts = []
        lasts = []
        for m in cutlass.range_constexpr(spec.intervals):
            packed = bounds[b, h, kv_load, m]
            firsts.append(Int32(packed))
            lasts.append(Int32(packed >> 32))
        for r in cutlass.range_constexpr(nrow):
            row = rows[r]
            visible = (firsts[0] <= row) & (row <= lasts[0])
            for m in cutlass.range_constexpr(1, spec.intervals):
                visible = visible | ((firsts[m] <= row) & (row <= lasts[m]))
            if const_expr(mask_seqlen):
                visible = visible & (local_rows[r] < mask.seqlen_q) & (kv < mask.seqlen_k)
            acc_S_mn[r, col] = acc_S_mn[r, col] if visible else -Float32.inf


class CostOrderScheduler:
    """FA4 tile scheduler (the ``SingleTileScheduler`` protocol: one work item per CTA) running the
    blocks in the order of :func:`.fa4_sparsity.cost_order`: bucket by bucket (heaviest first), every
    (head, batch) entry of the kernel in turn over the bucket's blocks. Each block of the lists covers
    ``rep`` of the kernel's blocks (64-row forward tiles or PackGQA's packed rows under 128-row
    lists; else 1). The order names list blocks only, so it holds whatever heads the kernel packs.
    Blocks past the kernel's count (a ragged last list block split) are CTAs with nothing to do.
    :func:`.plan.launch_items` is this decoding in Python. (Its protocol methods mirror FA4's
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
            spec = _spec_of(local["self"].mask_mod)
            return (spec, local["aux_data"].tensors) if spec is not None else (None, None)
        frame = frame.f_back
    return None, None


def _scheduler_proxy(plain, lpt, backward: bool):
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


_installed: bool | None = None


def install() -> bool:
    """Patch FA4 once (idempotent). False, with a warning, if FA4 is not the pinned version."""
    global _installed
    if _installed is not None:
        return _installed
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("flash-attn-4")
    except PackageNotFoundError:
        found = None  # unpacked wheels on the device's PYTHONPATH carry no metadata; check the code instead
    from flash_attn.cute import flash_bwd_sm90, flash_fwd_sm90, mask as fa4_mask, tile_scheduler

    original = fa4_mask.AttentionMask.apply_mask
    expected = ("self", "acc_S", "batch_idx", "head_idx", "m_block", "n_block", "thr_mma", "mask_seqlen",
                "mask_causal", "mask_local", "mask_mod", "aux_data", "fastdiv_mods")
    import inspect

    params = tuple(inspect.signature(getattr(original, "__wrapped__", original)).parameters)
    call_params = {name: tuple(inspect.signature(getattr(cls.__call__, "__wrapped__", cls.__call__)).parameters)
                   for name, cls in (("fwd", flash_fwd_sm90.FlashAttentionForwardSm90),
                                     ("bwd", flash_bwd_sm90.FlashAttentionBackwardSm90))}
    if (found not in (None, PINNED_FA4) or params != expected
            or any("aux_data" not in p or p[0] != "self" for p in call_params.values())
            or flash_fwd_sm90.SingleTileScheduler is not tile_scheduler.SingleTileScheduler
            or flash_bwd_sm90.SingleTileScheduler is not tile_scheduler.SingleTileScheduler):
        log.warning("flash-attn-4 %s is not the pinned %s: impl='cute' runs FA4 unchanged (per-score mask_mod, "
                    "grid order), slower on partial tiles and heavy blocks", found, PINNED_FA4)
        _installed = False
        return False

    def apply_mask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                   mask_local=False, mask_mod=None, aux_data=fa4_mask.AuxData(), fastdiv_mods=(None, None)):
        spec = _spec_of(mask_mod)
        if spec is not None and not mask_causal and not mask_local and aux_data.tensors is not None:
            use = spec.options.column_first and spec.q_per_mask_head % self.qhead_per_kvhead_packgqa == 0
            traced[("column_first" if use else "per_score") + ("_transposed" if self.swap_AB else "")] += 1
        else:
            use = False
        if use:
            return _apply_flashmask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen,
                                    aux_data.tensors, spec)
        return original(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                        mask_local, mask_mod, aux_data, fastdiv_mods)

    apply_mask.fm_parallel_original = original
    fa4_mask.AttentionMask.apply_mask = apply_mask
    flash_fwd_sm90.SingleTileScheduler = _scheduler_proxy(tile_scheduler.SingleTileScheduler,
                                                          tile_scheduler.SingleTileLPTScheduler, backward=False)
    flash_bwd_sm90.SingleTileScheduler = _scheduler_proxy(tile_scheduler.SingleTileScheduler,
                                                          tile_scheduler.SingleTileLPTScheduler, backward=True)
    _installed = True
    return True
