"""Two changes to FlashAttention-4's SM90 kernels, made only for FlashMask's own ``mask_mod``.

FA4 (pinned ``flash-attn-4==4.0.0b36``) treats a ``mask_mod`` as an opaque per-score predicate, and
schedules every block-sparse forward in plain grid order. Both cost FlashMask speed that its column
bounds make easy to win back, so this module replaces two trace-time pieces of FA4, and only when the
kernel being traced carries one of our ``mask_mod`` functions (:func:`register`); Flex, plain FA4 and
every other caller trace FA4's untouched code.

1. **Column-first masking** (``AttentionMask.apply_mask``). FA4 calls the ``mask_mod`` for each score a
   thread holds, and each call loads the column's bounds again (the compiler does not merge loads
   across the unrolled calls, checked in the PTX). FlashMask's predicate depends on the row only
   through a comparison, so here each thread loads the bounds once per *column* it holds and compares
   every row against them: the forward's 2 rows x 32 columns per thread need 32 loads instead of 64,
   the backward (scores transposed, many rows per column) a few instead of 64. Partial tiles are a
   quarter to a third of the visited tiles on packed documents and sliding windows.
2. **Heaviest-first forward schedule** (the forward's ``SingleTileScheduler``). FA4 runs causal
   attention with its LPT scheduler (query tiles in reverse, heads grouped to stay in L2) but the
   block-sparse path in grid order, so the longest rows of causal-like masks start last and leave the
   GPU idle at the end. Our forward uses the LPT scheduler as FA4's causal kernel does. Which tile runs
   where does not change any result.

Both are switched per ``mask_mod`` (:class:`Options`), so a benchmark can compare them in one process
(the options are part of the ``mask_mod``'s compile-cache hash). :func:`install` is idempotent and
refuses any FA4 version other than the pinned one, leaving FA4 unchanged (the backend still works,
without these two gains; a warning says so).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import min as dsl_min

__all__ = ["Options", "FlashMaskSpec", "install", "register", "forward_schedule", "traced"]

log = logging.getLogger(__name__)

PINNED_FA4 = "4.0.0b36"


@dataclass(frozen=True)
class Options:
    """Which of the two changes a ``mask_mod`` gets (both by default)."""

    column_first: bool = True
    heaviest_first: bool = True


@dataclass(frozen=True)
class FlashMaskSpec:
    """What the column-first masking must know about a FlashMask ``mask_mod`` (its shape class)."""

    batch_broadcast: bool  # Bm == 1: row 0 of the bounds serves every batch entry
    q_per_mask_head: int  # query heads per mask head
    intervals: int  # M, 1..4
    explicit_rows: bool  # rows read from aux_tensors[1]; else the local query index is the row
    options: Options = Options()


_SPECS: dict[int, tuple[object, FlashMaskSpec]] = {}  # id(mask_mod) -> (mask_mod kept alive, spec)
_state = threading.local()
# What kernels were traced with, counted at trace time (never at run time): "column_first" /
# "per_score" masking of FlashMask partial tiles, with "_transposed" for the backward's S^T layout,
# and "heaviest_first" / "grid_order" forward schedules. For tests and the compile check.
traced: collections.Counter = collections.Counter()


def register(mask_mod, spec: FlashMaskSpec) -> None:
    """Mark ``mask_mod`` as FlashMask's: kernels traced with it get the changes ``spec.options`` asks for."""
    _SPECS[id(mask_mod)] = (mask_mod, spec)


def _spec_of(mask_mod) -> FlashMaskSpec | None:
    entry = _SPECS.get(id(mask_mod)) if mask_mod is not None else None
    return entry[1] if entry is not None and entry[0] is mask_mod else None


@contextlib.contextmanager
def forward_schedule(heaviest_first: bool):
    """Around a call of FA4's forward: a kernel compiled inside uses the LPT schedule if asked."""
    previous = getattr(_state, "heaviest_first", False)
    _state.heaviest_first = heaviest_first
    try:
        yield
    finally:
        _state.heaviest_first = previous


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


def _lpt_scheduler_proxy(plain, lpt):
    """A stand-in for the forward's ``SingleTileScheduler``: FA4's LPT scheduler (with ``lpt=True``)
    for kernels compiled inside ``forward_schedule(True)``, the plain one otherwise. Later calls
    dispatch on the parameters' type, which records the choice."""

    class HeaviestFirstOrPlain:
        @staticmethod
        def to_underlying_arguments(args, *a, **kw):
            if getattr(_state, "heaviest_first", False):
                traced["heaviest_first"] += 1
                return lpt.to_underlying_arguments(dataclasses.replace(args, lpt=True), *a, **kw)
            traced["grid_order"] += 1
            return plain.to_underlying_arguments(args, *a, **kw)

        @staticmethod
        def _cls(params):
            return lpt if isinstance(params, lpt.Params) else plain

        @staticmethod
        def get_grid_shape(params, *a, **kw):
            return HeaviestFirstOrPlain._cls(params).get_grid_shape(params, *a, **kw)

        @staticmethod
        def create(params, *a, **kw):
            return HeaviestFirstOrPlain._cls(params).create(params, *a, **kw)

    return HeaviestFirstOrPlain


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
    from flash_attn.cute import flash_fwd_sm90, mask as fa4_mask, tile_scheduler

    original = fa4_mask.AttentionMask.apply_mask
    expected = ("self", "acc_S", "batch_idx", "head_idx", "m_block", "n_block", "thr_mma", "mask_seqlen",
                "mask_causal", "mask_local", "mask_mod", "aux_data", "fastdiv_mods")
    import inspect

    params = tuple(inspect.signature(getattr(original, "__wrapped__", original)).parameters)
    if (found not in (None, PINNED_FA4) or params != expected
            or flash_fwd_sm90.SingleTileScheduler is not tile_scheduler.SingleTileScheduler):
        log.warning("flash-attn-4 %s is not the pinned %s: impl='cute' runs FA4 unchanged (per-score mask_mod, "
                    "grid-order forward), slower on partial tiles", found, PINNED_FA4)
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
    flash_fwd_sm90.SingleTileScheduler = _lpt_scheduler_proxy(tile_scheduler.SingleTileScheduler,
                                                              tile_scheduler.SingleTileLPTScheduler)
    _installed = True
    return True
