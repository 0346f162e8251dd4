"""The kernels' forms of the tile rule (masks/blocks.py): the grid form and the range form agree with
classify_tiles, a ragged last key block is never FULL, and fa4_sparsity no longer needs plan's privates."""

import torch

from fm_parallel import masks
from fm_parallel.masks import TileClass, classify_tiles, row_block_bounds
from fm_parallel.masks.blocks import classes_in_ranges, consecutive_tile_ranges, tile_classes


def _ragged_case():
    return masks.union(masks.sliding_window(100, 13, sinks=2), masks.document([40, 30, 30], causal=False))


def test_tile_classes_is_classify_tiles_with_the_ragged_last_block_never_full():
    m, bq, bk = _ragged_case(), 16, 24  # 100 % 24 != 0: the last key block is ragged
    rows = torch.arange(7, 95)
    lo, hi = row_block_bounds(rows, bq)
    want = classify_tiles(m.block_summary(bk), lo, hi)
    assert (want[..., -1] == TileClass.FULL).any()  # the case exercises the amendment
    want[..., -1] = torch.where(want[..., -1] == TileClass.FULL, int(TileClass.PARTIAL), want[..., -1])
    assert torch.equal(tile_classes(m, rows, bq, bk), want)


def test_the_range_form_reads_the_same_classes():
    m, bq, bk, offset, num_rows = _ragged_case(), 8, 24, 5, 90
    ranges, tq, tk = consecutive_tile_ranges(m, offset, num_rows, bq, bk)
    grid = tile_classes(m, torch.arange(offset, offset + num_rows), bq, bk)  # [B, Hm, Tq, Tk]
    points = torch.arange(-1, tq + 1).expand(*ranges[0].shape[:3], -1)  # every query block, and outside
    got = classes_in_ranges(ranges, points, tq)  # [B, Hm, Tk, Tq + 2]
    assert torch.equal(got[..., 1:-1].transpose(-1, -2), grid)
    assert (got[..., 0] == -1).all() and (got[..., -1] == -1).all()


def test_fa4_sparsity_takes_the_exported_helper():
    from fm_parallel.kernels.fa4 import sparsity as fa4_sparsity

    assert fa4_sparsity.tile_classes is tile_classes and not hasattr(fa4_sparsity, "_classes")
