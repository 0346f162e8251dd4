"""The range-based plan builder equals the dense-grid one, run for run, on consecutive query rows."""

import pytest
import torch

from fm_parallel import FlashMask, masks
from fm_parallel.kernels.plan import build_plans, build_plans_consecutive
from fm_parallel.masks import classify_tiles, row_block_bounds, tile_ranges
from tests.helpers import random_intervals
from tests.helpers import mask_families

FIELDS = ("full_offsets", "full_runs", "part_offsets", "part_runs", "order")


def assert_same(got, want):
    for name in FIELDS:
        a, b = getattr(got, name).cpu(), getattr(want, name).cpu()  # a plan built on the GPU, too
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.num_outer, got.transposed, got.block_m, got.block_n) == (want.num_outer, want.transposed, want.block_m, want.block_n)


@pytest.mark.parametrize("family", list(mask_families(77)))
@pytest.mark.parametrize("bm,bn", [(16, 16), (32, 8), (8, 64)])
def test_every_family(family, bm, bn):
    m = mask_families(77)[family]
    for got, want in zip(build_plans_consecutive(m, 0, m.num_rows, bm, bn), build_plans(m, torch.arange(m.num_rows), bm, bn)):
        assert_same(got, want)


def random_case(seed: int, sizes: tuple[int, int] = (20, 200), block_unit: int = 8):
    """A random multi-interval mask (batch and heads too), block shape and slice of consecutive rows:
    ``(mask, block_m, block_n, row_offset, num_rows)``."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(*sizes, (1,), generator=g))
    intervals, batch, heads = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (5, 3, 3))
    fms, fme, _ = random_intervals(batch, heads, n, n, intervals, seed=seed)
    bm, bn = (int(x) * block_unit for x in torch.randint(1, 5, (2,), generator=g))
    offset = int(torch.randint(0, n // 2, (1,), generator=g))  # a ring chunk's rows
    rows = int(torch.randint(1, n - offset + 1, (1,), generator=g))
    return FlashMask(fms, fme, n), bm, bn, offset, rows


@pytest.mark.parametrize("seed", range(40))
def test_random_multi_interval_masks_and_row_slices(seed):
    m, bm, bn, offset, rows = random_case(seed)
    want = build_plans(m, torch.arange(offset, offset + rows), bm, bn)
    for got, w in zip(build_plans_consecutive(m, offset, rows, bm, bn), want):
        assert_same(got, w)


def test_tile_ranges_restate_the_tile_rule():
    m = masks.union(masks.sliding_window(200, 17, sinks=2), masks.document([60, 70, 70], causal=False))
    summary = m.block_summary(16)
    offset, rows, block = 13, 150, 32
    lo, hi = row_block_bounds(torch.arange(offset, offset + rows), block)
    cls = classify_tiles(summary, lo, hi)  # [B, Hm, Tq, Tk]
    r_first, r_last, c_first, c_last = tile_ranges(summary, offset, rows, block)
    t = torch.arange(cls.shape[2]).view(1, 1, -1, 1, 1)
    covers = ((c_first.unsqueeze(2) <= t) & (t <= c_last.unsqueeze(2))).any(-1)
    reaches = ((r_first.unsqueeze(2) <= t) & (t <= r_last.unsqueeze(2))).any(-1)
    assert torch.equal(torch.where(covers, 2, torch.where(reaches, 1, 0)).to(torch.int8), cls)


def test_fully_masked_rows_and_an_empty_mask():
    empty = masks.document([40], n=100)  # rows 40..99 see nothing
    for got, want in zip(build_plans_consecutive(empty, 0, 100, 16, 16), build_plans(empty, torch.arange(100), 16, 16)):
        assert_same(got, want)
    got, _ = build_plans_consecutive(empty, 48, 52, 16, 16)  # a chunk of only masked rows: no runs at all
    assert got.full_runs.numel() == 0 and got.part_runs.numel() == 0
