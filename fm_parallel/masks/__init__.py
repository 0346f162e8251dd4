"""FlashMask masks: the type, builders, combinators, converters and the block summary / tile rule."""

from fm_parallel.masks.blocks import BlockSummary, TileClass, classify_tiles, count_tiles, row_block_bounds, summarize, tile_ranges
from fm_parallel.masks.builders import (
    causal,
    document,
    dpo,
    from_dense,
    full,
    intersect,
    prefix_lm,
    preference,
    sample_lengths,
    sliding_window,
    stack,
    union,
)
from fm_parallel.masks.converters import from_paddle, to_block_mask, to_flex_mask_mod, to_paddle
from fm_parallel.masks.flashmask import MAX_INTERVALS, FlashMask, MaskStats
from fm_parallel.masks.intervals import MaskNotExpressible

__all__ = [
    "tile_ranges",
    "FlashMask", "MaskStats", "MaskNotExpressible", "MAX_INTERVALS",
    "causal", "full", "document", "sample_lengths", "prefix_lm", "dpo", "preference", "sliding_window",
    "union", "intersect", "stack", "from_dense",
    "to_paddle", "from_paddle", "to_flex_mask_mod", "to_block_mask",
    "BlockSummary", "TileClass", "summarize", "classify_tiles", "row_block_bounds", "count_tiles",
]
