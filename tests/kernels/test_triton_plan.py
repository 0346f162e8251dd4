"""The Triton plan builder (kernels/triton/plan.py) equals the PyTorch builders array for array.

Under the interpreter on the CPU; a program's scan is cut into chunks of 8 inner blocks here, so runs
that cross chunk boundaries are exercised (the GPU uses 1024)."""

import pytest
import torch

from fm_parallel import FlashMask, masks
from fm_parallel.kernels.triton import plan as triton_plan
from fm_parallel.kernels.plan import build_plans, build_plans_consecutive
from tests.kernels.test_plan_consecutive import assert_same, random_case
from tests.helpers import mask_families

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(triton_plan, "_CHUNK", 8)


def triton_plans(m, offset, rows, bm, bn):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_plans_consecutive(m.to(device), offset, rows, bm, bn, builder="triton")


def same(got, want):
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("family", list(mask_families(77)))
def test_every_family(family):
    m = mask_families(77)[family]
    same(triton_plans(m, 0, m.num_rows, 16, 8), build_plans(m, torch.arange(m.num_rows), 16, 8))


@pytest.mark.parametrize("seed", range(8))
def test_random_multi_interval_masks_heads_and_row_slices(seed):
    m, bm, bn, offset, rows = random_case(seed, sizes=(40, 160), block_unit=4)
    same(triton_plans(m, offset, rows, bm, bn), build_plans(m, torch.arange(offset, offset + rows), bm, bn))


def test_torch_and_triton_builders_agree_on_a_union():
    m = masks.union(masks.sliding_window(300, 37, sinks=2), masks.document([100, 90, 110], causal=False))
    same(triton_plans(m, 13, 250, 16, 8), build_plans_consecutive(m, 13, 250, 16, 8, builder="torch"))


def test_fully_masked_rows_and_an_empty_mask():
    empty = masks.document([40], n=100)  # rows 40..99 see nothing
    same(triton_plans(empty, 0, 100, 16, 16), build_plans(empty, torch.arange(100), 16, 16))
    nothing = FlashMask(torch.full((50,), 30), torch.full((50,), 29), 50)  # every interval empty
    plans = triton_plans(nothing, 0, 50, 16, 16)
    assert all(p.full_runs.shape == (0, 2) and p.part_runs.shape == (0, 2) for p in plans)
    same(plans, build_plans(nothing, torch.arange(50), 16, 16))


def test_bad_builder_and_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="builder: expected"):
        build_plans_consecutive(masks.causal(10), 0, 10, 4, 4, builder="numpy")
    with pytest.raises(ValueError, match=r"ranges: expected \[R, 4 \* M, T_k\] int32"):
        triton_plan.plans_from_ranges(torch.zeros(1, 3, 5, dtype=torch.int32), 2, 4, 4)


def _bounds_case(m, bm, bn):
    from fm_parallel.kernels.plan import consecutive_ranges, packed_ranges
    from fm_parallel.masks import classify_tiles, row_block_bounds

    ranges, tq, tk = consecutive_ranges(m, 0, m.num_rows, bm, bn)
    packed = packed_ranges(ranges)
    lo, hi = row_block_bounds(torch.arange(m.num_rows), bm)
    visited = classify_tiles(m.block_summary(bn), lo, hi).flatten(0, 1) > 0  # [R, T_q, T_k]
    return packed, tq, visited


@pytest.mark.parametrize("family", list(mask_families(77)))
def test_scan_bounds_hold_every_visited_tile(family):
    """Every tile the rule visits lies inside its program's [first, last] span, both orientations."""
    packed, tq, visited = _bounds_case(mask_families(77)[family], 8, 8)
    for transposed, grid in ((False, visited), (True, visited.transpose(1, 2))):
        first, last = triton_plan._inner_bounds(packed, tq, transposed).view(2, grid.shape[0], grid.shape[1])
        inner = torch.arange(grid.shape[2])
        inside = (first.unsqueeze(-1) <= inner) & (inner <= last.unsqueeze(-1))
        assert not (grid & ~inside).any()


def test_scan_bounds_of_packed_documents_are_about_one_document():
    m = masks.document([50, 70, 80, 64, 56])
    packed, tq, visited = _bounds_case(m, 8, 8)
    first, last = triton_plan._inner_bounds(packed, tq, False)
    assert int((last - first + 1).max()) <= -(-80 // 8) + 1  # the longest document in blocks (+1 straddled)
    assert int((last - first + 1).max()) < visited.shape[-1] // 3
