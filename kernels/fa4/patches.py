"""Two changes to FlashAttention-4's SM90 kernels, made only for FlashMask's own ``mask_mod``.

FA4 (the pinned version, :mod:`.pin`) treats a ``mask_mod`` as an opaque per-score predicate, and
schedules every block-sparse kernel in plain grid order. Both cost FlashMask speed that its column
bounds make easy to win back, so these modules replace trace-time pieces of FA4, and only when the
kernel being traced carries one of our ``mask_mod`` functions (:func:`.spec.register`); Flex, plain FA4 and
every other caller trace FA4's untouched code.

1. **Column-first masking** (:mod:`.column_masking`, ``AttentionMask.apply_mask``). FA4 calls the ``mask_mod`` for each score a
   thread holds, and each call loads the column's bounds again (the compiler does not merge loads
   across the unrolled calls, checked in the PTX). FlashMask's predicate depends on the row only
   through a comparison, so here each thread loads the bounds once per *column* it holds and compares
   every row against them: the forward's 2 rows x 32 columns per thread need 32 loads instead of 64,
   the backward (scores transposed, many rows per column) a few instead of 64. Partial tiles are a
   quarter to a third of the visited tiles on packed documents and sliding windows.
2. **Heaviest-first schedule** (:mod:`.cost_schedule`, the ``SingleTileScheduler`` of the forward and the backward). FA4 runs
   the block-sparse path in grid order, one CTA per (block, head, batch); a block that visits many
   more tiles than the others (the query block of global rows, the key block of attention sinks, the
   last rows of causal-like masks) may then start late and run alone at the end: up to 1.5x the
   kernel's ideal time on windows with sinks or global tokens (launch/bench/schedule_model.py at e941a68), and
   measured on the H200: a 1.36-1.55x slower backward on sliding windows with sinks. FA4's causal answer,
   reversing the query blocks (its LPT scheduler), only helps masks whose heavy blocks are the last
   ones. Here the CTAs run in an order given at run time (:class:`CostOrderScheduler`): blocks in
   buckets of visited tiles, heaviest bucket first, each bucket run head by head
   (:func:`.sparsity.cost_order`, from the same block lists), so any mask's heavy blocks start
   early while the CTAs in flight share one or two heads' data in L2 (sorting every (block, head)
   item by cost with heads interleaved lost 10% on the DPO backward to L2 misses). The order tensor
   is the last of the ``mask_mod``'s auxiliary tensors. Which tile runs where changes no result.

Both are switched per ``mask_mod`` (:class:`.spec.Options`), so a benchmark can compare them in one process
(the options are part of the ``mask_mod``'s compile-cache hash). :func:`install` is idempotent and
refuses any FA4 version other than the pinned one, leaving FA4 unchanged (the backend still works,
without these gains; a warning says so).
"""

from __future__ import annotations

import logging

from fm_parallel.kernels.fa4.column_masking import apply_flashmask
from fm_parallel.kernels.fa4.cost_schedule import scheduler_proxy
from fm_parallel.kernels.fa4.pin import FA4_DISTRIBUTION, pinned_fa4
from fm_parallel.kernels.fa4.spec import SCHEDULES, FlashMaskSpec, Options, register, spec_of, traced

__all__ = ["SCHEDULES", "FlashMaskSpec", "Options", "install", "register", "traced"]

log = logging.getLogger(__name__)


_installed: bool | None = None


def install() -> bool:
    """Patch FA4 once (idempotent). False, with a warning, if FA4 is not the pinned version."""
    global _installed
    if _installed is not None:
        return _installed
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(FA4_DISTRIBUTION)
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
    if (found not in (None, pinned_fa4()) or params != expected
            or any("aux_data" not in p or p[0] != "self" for p in call_params.values())
            or flash_fwd_sm90.SingleTileScheduler is not tile_scheduler.SingleTileScheduler
            or flash_bwd_sm90.SingleTileScheduler is not tile_scheduler.SingleTileScheduler):
        log.warning("flash-attn-4 %s is not the pinned %s: impl='cute' runs FA4 unchanged (per-score mask_mod, "
                    "grid order), slower on partial tiles and heavy blocks", found, pinned_fa4())
        _installed = False
        return False

    def apply_mask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                   mask_local=False, mask_mod=None, aux_data=fa4_mask.AuxData(), fastdiv_mods=(None, None)):
        spec = spec_of(mask_mod)
        if spec is not None and not mask_causal and not mask_local and aux_data.tensors is not None:
            use = spec.options.column_first and spec.q_per_mask_head % self.qhead_per_kvhead_packgqa == 0
            traced[("column_first" if use else "per_score") + ("_transposed" if self.swap_AB else "")] += 1
        else:
            use = False
        if use:
            return apply_flashmask(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen,
                                    aux_data.tensors, spec)
        return original(self, acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen, mask_causal,
                        mask_local, mask_mod, aux_data, fastdiv_mods)

    apply_mask.fm_parallel_original = original
    fa4_mask.AttentionMask.apply_mask = apply_mask
    flash_fwd_sm90.SingleTileScheduler = scheduler_proxy(tile_scheduler.SingleTileScheduler,
                                                          tile_scheduler.SingleTileLPTScheduler, backward=False)
    flash_bwd_sm90.SingleTileScheduler = scheduler_proxy(tile_scheduler.SingleTileScheduler,
                                                          tile_scheduler.SingleTileLPTScheduler, backward=True)
    _installed = True
    return True
