"""The tile rule against the dense truth: never wrong, and exact on the common masks."""

import pytest
import torch

from fm_parallel import masks
from fm_parallel.masks import TileClass
from tests.helpers import random_intervals, truth


def classify(mask, positions, block_q, block_k):
    lo, hi = masks.row_block_bounds(positions, block_q)
    return masks.classify_tiles(mask.block_summary(block_k), lo, hi)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_q,block_k", [(4, 4), (8, 3), (5, 16)])
def test_rule_is_conservative_on_random_multi_interval(seed, block_q, block_k):
    fms, fme, picture = random_intervals(1, 2, 41, 37, 4, seed)
    m = masks.FlashMask(fms, fme, 41)
    g = torch.Generator().manual_seed(seed)
    for positions in (torch.arange(41), torch.randperm(41, generator=g)[:23]):
        got = classify(m, positions, block_q, block_k)
        for h in range(2):
            want = truth(picture[0, h], positions, block_q, block_k)
            assert not ((got[0, h] == TileClass.SKIP) & (want != TileClass.SKIP)).any()
            assert not ((got[0, h] == TileClass.FULL) & (want != TileClass.FULL)).any()
            # A tile the rule calls partial may be anything; the others must agree exactly.
            sure = got[0, h] != TileClass.PARTIAL
            assert torch.equal(got[0, h][sure], want[sure])


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(100),
        masks.document([17, 0, 40, 3, 30], n=100),
        masks.sliding_window(100, 12),
        masks.dpo(50, 25, 25),
        masks.full(100),
        # Two intervals in some columns, one in others (sinks and global rows merge into one interval
        # in the sink columns): tiles covered through different slots are full (the cover slot).
        masks.union(masks.sliding_window(100, 30, sinks=3), masks.FlashMask(torch.zeros(100, dtype=torch.int32), torch.full((100,), 2))),
        masks.union(masks.sliding_window(100, 40, sinks=5), masks.document([50, 50], causal=True)),
    ],
    ids=["causal", "document", "sliding", "dpo", "full", "global_window", "sinks_window_docs"],
)
@pytest.mark.parametrize("block", [1, 7, 16])
def test_rule_is_exact_on_common_masks(mask, block):
    positions = torch.arange(100)
    got = classify(mask, positions, block, block)[0, 0]
    assert torch.equal(got, truth(mask.to_dense()[0, 0], positions, block, block))


def test_the_cover_slot_makes_tiles_full_that_slots_alone_leave_partial():
    """Global rows 0..2 + a window + sinks: below the global rows, key block 0 is covered by slot 0 in
    the sink columns and by slot 1 in the others. The slots alone call those tiles partial."""
    n, block = 128, 8
    mask = masks.union(masks.sliding_window(n, 64, sinks=3), masks.FlashMask(torch.zeros(n, dtype=torch.int32), torch.full((n,), 2)))
    assert mask.max_intervals == 2
    summary = mask.block_summary(block)
    assert summary.min_fms.shape[-1] == 3  # two slots and the cover slot
    got = classify(mask, torch.arange(n), block, block)[0, 0]
    want = truth(mask.to_dense()[0, 0], torch.arange(n), block, block)
    assert torch.equal(got, want)
    slots_only = masks.blocks.BlockSummary(block, n, *(t[..., :2] for t in (summary.min_fms, summary.max_fms,
                                                                            summary.min_fme, summary.max_fme)))
    lo, hi = masks.row_block_bounds(torch.arange(n), block)
    before = masks.classify_tiles(slots_only, lo, hi)[0, 0]
    assert int((before == TileClass.FULL).sum()) < int((got == TileClass.FULL).sum())


def test_rule_with_q_offset_slice():
    m = masks.document([30, 50, 20])
    positions = torch.arange(40, 72)  # a ring chunk of 32 queries
    got = classify(m, positions, 8, 8)[0, 0]
    assert torch.equal(got, truth(m.to_dense()[0, 0], positions, 8, 8))


def test_stats_counts_and_density():
    s = masks.causal(8).stats(block=2)
    assert (s.tiles_total, s.tiles_skipped, s.tiles_partial, s.tiles_full) == (16, 6, 4, 6)
    assert s.visible_pairs == 36 and s.density == pytest.approx(36 / 64)
    m = masks.document([100, 28], n=130)
    s = m.stats(block=32)
    t = truth(m.to_dense()[0, 0], torch.arange(130), 32, 32)
    assert (s.tiles_skipped, s.tiles_partial, s.tiles_full) == tuple(int((t == c).sum()) for c in TileClass)
    assert s.visible_pairs == 100 * 101 // 2 + 28 * 29 // 2
    assert s.skip_ratio == pytest.approx(s.tiles_skipped / s.tiles_total)


def test_summary_is_cached_and_short_last_block_exact():
    m = masks.sliding_window(10, 3)
    assert m.block_summary(4) is m.block_summary(4)
    summary = m.block_summary(4)
    assert summary.num_blocks == 3
    assert summary.min_fms[0, 0, 2, 0] == 8 and summary.max_fms[0, 0, 2, 0] == 9
    with pytest.raises(ValueError, match="block: expected a positive int, got 0"):
        masks.summarize(m, 0)
