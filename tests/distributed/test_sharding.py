"""Sharding plans: positions, round trips, the exact pair table, and mask-aware load balance."""

import pytest
import torch

from fm_parallel import masks
from fm_parallel.distributed import ParallelDims, pair_counts, row_work, shard
from fm_parallel.distributed.sharding import pair_table_and_key_windows
from tests.helpers import random_intervals


def test_contiguous_and_zigzag_positions():
    assert [p.tolist() for p in shard(8, 2, "contiguous").positions] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.tolist() for p in shard(8, 2, "zigzag").positions] == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("balance", ["contiguous", "zigzag", "mask"])
def test_shard_unshard_round_trip_and_equal_counts(balance):
    m = masks.document([100, 60, 96])
    plan = shard(m, 4, balance)
    assert sorted(torch.cat(plan.positions).tolist()) == list(range(256))
    assert {p.numel() for p in plan.positions} == {64}
    x = torch.randn(2, 3, 256)
    parts = [plan.shard(x, r, dim=-1) for r in range(4)]
    assert torch.equal(plan.unshard(parts, dim=-1), x)
    ids = torch.arange(256)
    assert torch.equal(plan.shard(ids, 1, dim=0), plan.position_ids(1))


def test_pair_counts_and_row_work_match_the_dense_mask():
    m = masks.union(masks.sliding_window(96, 7, sinks=2), masks.document([40, 56], causal=False))
    plan = shard(m, 4, "mask")
    dense = m.to_dense()[0, 0]
    table = pair_counts(m, plan.positions)
    for r in range(4):
        for j in range(4):
            assert table[r, j] == int(dense[plan.positions[r]][:, plan.positions[j]].sum())
    assert torch.equal(row_work(m), dense.sum(1))


@pytest.mark.parametrize("seed", range(6))
def test_pair_counts_on_random_bounds_match_the_dense_mask(seed):
    """Random bounds: up to 4 intervals per column (empty ones among them), batch and heads, rows of a
    rank in any order, unequal shares; counted over every batch row and head."""
    n = 61 + seed
    fms, fme, picture = random_intervals(2, 2, n, n, 1 + seed % 4, seed)  # picture: [B, H, rows, keys]
    mask = masks.FlashMask(fms, fme, n)
    g = torch.Generator().manual_seed(seed)
    positions = list(torch.tensor_split(torch.randperm(n, generator=g), [5, 20 + seed, 40]))
    table = pair_counts(mask, positions)
    same_table, windows = pair_table_and_key_windows(mask, positions)
    assert torch.equal(same_table, table)
    for r, q in enumerate(positions):
        for j, k in enumerate(positions):
            block = picture[:, :, q][:, :, :, k]  # rank j's keys in its local order
            assert table[r, j] == int(block.sum()), (r, j)
            # The key window: first to last local key (index in positions[j]) of rank j that some
            # query of rank r sees.
            seen = block.flatten(0, 2).any(0).nonzero().flatten()
            expected = (int(seen.min()), int(seen.max()) + 1) if seen.numel() else (0, 0)
            assert tuple(windows[r, j].tolist()) == expected, (r, j)


def imbalance(mask, plan):
    work = row_work(mask)
    per_rank = torch.stack([work[p].sum() for p in plan.positions]).double()
    return (per_rank.max() / per_rank.mean()).item()


def families(n):
    lens = masks.sample_lengths(n, mean=2048, seed=1)
    return {
        "causal": masks.causal(n),
        "docs": masks.document(lens),
        "dpo": masks.dpo(n // 2, n // 4, n // 4),
        "sliding_sinks": masks.sliding_window(n, 1024, sinks=4),
        "prefix_lm": masks.prefix_lm(n, n // 4),
    }


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("family", ["causal", "docs", "dpo", "sliding_sinks", "prefix_lm"])
def test_mask_balance_target(world, family):
    m = families(32768)[family]
    assert imbalance(m, shard(m, world, "mask")) <= 1.05
    if family == "causal":
        assert imbalance(m, shard(m, world, "contiguous")) > 1.5  # what balancing buys


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: shard(10, 4, "contiguous"), "expected a length divisible by 4"),
        (lambda: shard(12, 4, "zigzag"), "expected a length divisible by 8"),
        (lambda: shard(16, 4, "mask"), "balance='mask' needs the FlashMask"),
        (lambda: shard(16, 0), "world_size: expected a positive int"),
        (lambda: shard(16, 2, "random"), "balance: expected one of"),
        (lambda: shard(masks.causal(16), 2, "mask", blocks_per_rank=3), "blocks_per_rank: expected a divisor"),
        (lambda: ParallelDims(8, ring=3), "world_size: expected a multiple of ring x ulysses"),
        (lambda: ParallelDims(8, ring=0), "ring: expected a positive int"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_parallel_dims():
    d = ParallelDims(8, ring=2, ulysses=2)
    assert (d.cp, d.dp) == (4, 2)
