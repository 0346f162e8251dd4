"""FA4 block-sparsity lists from a FlashMask, checked tile by tile against the dense picture."""

import math

import pytest
import torch

from fm_parallel import FlashMask, masks
from fm_parallel.kernels.fa4.sparsity import fa4_block_sparsity
from fm_parallel.masks import TileClass
from tests.helpers import truth
from tests.helpers import random_intervals
from tests.helpers import mask_families

N = 77  # ragged against every tile size below
FAMILIES = mask_families(N)


def expected(mask: FlashMask, positions: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """``[Bm, Hm, T_q, T_k]`` classes by brute force; a ragged last key block is never FULL (its
    missing columns must be masked), as in the Triton plans."""
    dense = mask.to_dense()
    out = torch.stack([torch.stack([truth(dense[b, h], positions, bq, bk) for h in range(mask.heads)])
                       for b in range(mask.batch)])
    if mask.num_keys % bk:
        last = out[..., -1]
        out[..., -1] = torch.where(last == TileClass.FULL, torch.full_like(last, int(TileClass.PARTIAL)), last)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("bq,bk", [(16, 8), (8, 32), (128, 128)])
def test_every_family_every_tile(family, bq, bk):
    m = FAMILIES[family]
    fwd, bwd = fa4_block_sparsity(m, bq, bk)
    want = expected(m, torch.arange(m.num_rows), bq, bk)
    assert fwd.full_block_cnt.shape == want.shape[:3] and fwd.full_block_idx.shape == want.shape
    assert fwd.full_block_cnt.dtype == torch.int32 and fwd.mask_block_idx.dtype == torch.int32
    assert torch.equal(fwd.classes(), want)
    assert torch.equal(bwd.classes(), want.transpose(-1, -2))
    # Ascending indices, zero past the count: the layout FA4 reads.
    for cnt, idx in ((fwd.full_block_cnt, fwd.full_block_idx), (bwd.mask_block_cnt, bwd.mask_block_idx)):
        valid = torch.arange(idx.shape[-1]) < cnt.unsqueeze(-1)
        assert (idx[~valid] == 0).all()
        steps = idx[..., 1:] - idx[..., :-1]
        assert (steps[valid[..., 1:]] > 0).all()


def test_query_slice_multi_interval_and_batch_rows():
    i, j = torch.arange(90).view(-1, 1), torch.arange(90).view(1, -1)
    band_and_late_rows = ((i >= j) & (i - j < 10)) | ((i >= 60) & (j < 50))  # two row intervals per early column
    m = masks.stack([masks.from_dense(band_and_late_rows), masks.document([40, 50])])
    assert m.batch == 2 and m.max_intervals >= 2
    positions = torch.arange(23, 71)  # a ring chunk: rows 23..70 of the global mask
    fwd, bwd = fa4_block_sparsity(m, 8, 8, positions=positions)
    want = expected(m, positions, 8, 8)
    assert torch.equal(fwd.classes(), want)
    assert torch.equal(bwd.classes(), want.transpose(-1, -2))
    kinds = set(want.unique().tolist())
    assert kinds == {int(TileClass.SKIP), int(TileClass.PARTIAL), int(TileClass.FULL)}, kinds


def test_mask_heads_per_kv_head_are_repeated_to_the_query_heads():
    fms, fme, _ = random_intervals(1, 2, 64, 64, 2, seed=3)
    m = FlashMask(fms, fme, 64)
    fwd, _ = fa4_block_sparsity(m, 16, 16, num_heads=6)
    classes = fwd.classes()
    assert classes.shape[1] == 6
    one, _ = fa4_block_sparsity(m, 16, 16)
    assert torch.equal(classes, one.classes().repeat_interleave(3, dim=1))
    with pytest.raises(ValueError, match="num_heads: expected a multiple of the mask's 2 heads, got 5"):
        fa4_block_sparsity(m, 16, 16, num_heads=5)
    with pytest.raises(ValueError, match="block_q, block_k: expected positive tile sizes, got 0, 16"):
        fa4_block_sparsity(m, 0, 16)


def test_handing_over_to_fa4_needs_the_cute_extra():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        fwd, _ = fa4_block_sparsity(masks.causal(64), 16, 16)
        with pytest.raises(ImportError, match="needs flash-attn-4"):
            fwd.to_fa4()
    else:
        pytest.skip("flash-attn-4 is installed here: the hand-over is checked by the GPU script instead")


@pytest.mark.parametrize("family", ["document", "dpo", "sliding_sinks", "prefix_lm_docs", "union_multi"])
def test_dq_write_order_ranks_each_key_block_within_its_query_block(family):
    """FA4's deterministic backward: entry i of key block n's lists (query block m) carries the number
    of visited key blocks before n in query block m's row: brute force over the class grid."""
    m = FAMILIES[family]
    fwd, bwd = fa4_block_sparsity(m, 8, 16, write_order=True)
    assert fa4_block_sparsity(m, 8, 16)[1].dq_write_order is None  # only on request
    grid = fwd.classes()[0, 0]  # [T_q, T_k]
    visited = grid != TileClass.SKIP
    checked = 0
    for cnt, idx, order in ((bwd.mask_block_cnt, bwd.mask_block_idx, bwd.dq_write_order),
                            (bwd.full_block_cnt, bwd.full_block_idx, bwd.dq_write_order_full)):
        assert order.shape == idx.shape and order.dtype == torch.int32
        for n in range(idx.shape[2]):
            for i in range(int(cnt[0, 0, n])):
                q_block = int(idx[0, 0, n, i])
                assert int(order[0, 0, n, i]) == int(visited[q_block, :n].sum()), (n, i, q_block)
                checked += 1
    assert checked == int(visited.sum())  # every visited tile has exactly one rank
    assert fwd.dq_write_order is None  # the forward lists need none


@pytest.mark.parametrize("head_dim,shape", [(64, (128, 128)), (96, (128, 128)), (128, (128, 128)),
                                            (160, (128, 96)), (192, (128, 96)), (256, (128, 64))])
def test_tile_shape_follows_fa4_sm90_tiles(head_dim, shape):
    from fm_parallel.kernels.fa4.sparsity import fa4_tile_shape

    assert fa4_tile_shape(head_dim) == shape


def test_tile_shape_rejects_head_dims_fa4_cannot_run():
    from fm_parallel.kernels.fa4.sparsity import fa4_tile_shape

    with pytest.raises(ValueError, match="head_dim: expected 8..256 for FA4's SM90 kernels, got 320"):
        fa4_tile_shape(320)


@pytest.mark.parametrize("offset", [0, 23])
def test_packed_bounds_decode_to_the_mask_as_the_mask_mod_reads_them(offset):
    """The mask_mod's arithmetic, in torch: low 32 bits = first row, arithmetic >> 32 = last row, both
    relative to the offset, compared with the local query index; multi-interval, batch rows, empty
    intervals and rows that see nothing included."""
    from fm_parallel.kernels.fa4.sparsity import pack_bounds

    i, j = torch.arange(90).view(-1, 1), torch.arange(90).view(1, -1)
    two_intervals = ((i >= j) & (i - j < 10)) | ((i >= 60) & (j < 50))
    m = masks.stack([masks.from_dense(two_intervals), masks.document([40, 30], n=90)])  # rows 70.. see nothing
    packed = pack_bounds(m.fms, m.fme, offset)
    assert packed.dtype == torch.int64 and packed.shape == m.fms.shape
    first = (packed & 0xFFFFFFFF).to(torch.int32)  # Int32(packed): truncation
    last = (packed >> 32).to(torch.int32)
    local = torch.arange(90 - offset).view(1, 1, -1, 1, 1)  # local query index = global row - offset
    visible = ((first.unsqueeze(2) <= local) & (local <= last.unsqueeze(2))).any(-1)  # [B, H, Nq, Nk]
    assert torch.equal(visible, m.to_dense(rows=torch.arange(offset, 90)))


# The GPU builder for consecutive rows (Triton, under the interpreter here): the same lists exactly.
FIELDS = ("full_block_cnt", "full_block_idx", "mask_block_cnt", "mask_block_idx")


def assert_same_lists(got, want):
    for g, w in zip(got, want):
        for name in FIELDS:
            a, b = getattr(g, name).cpu(), getattr(w, name)
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), name
        assert (g.block_size, g.transposed) == (w.block_size, w.transposed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_consecutive_builder_equals_the_dense_grid(family, monkeypatch):
    pytest.importorskip("triton")
    from fm_parallel.kernels.triton import plan as triton_plan
    from fm_parallel.kernels.fa4.sparsity import fa4_block_sparsity_consecutive

    monkeypatch.setattr(triton_plan, "_CHUNK", 4)  # lists cross chunk boundaries
    m = FAMILIES[family]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = fa4_block_sparsity_consecutive(m.to(device), 16, 8, None, 0, m.num_rows)
    assert_same_lists(got, fa4_block_sparsity(m, 16, 8))


@pytest.mark.parametrize("seed", range(4))
def test_consecutive_builder_on_row_slices_batches_and_kv_head_masks(seed, monkeypatch):
    pytest.importorskip("triton")
    from fm_parallel.kernels.triton import plan as triton_plan
    from fm_parallel.kernels.fa4.sparsity import fa4_block_sparsity_consecutive

    monkeypatch.setattr(triton_plan, "_CHUNK", 4)
    fms, fme, _ = random_intervals(2, 2, 70, 70, 1 + seed % 3, seed=seed)
    m = FlashMask(fms, fme, 70)
    offset, rows = 7 * seed, 70 - 9 * seed
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton on a GPU, the interpreter here
    got = fa4_block_sparsity_consecutive(m.to(device), 8, 16, 4, offset, rows)  # 4 query heads over 2 mask heads
    assert_same_lists(got, fa4_block_sparsity(m, 8, 16, num_heads=4, positions=torch.arange(offset, offset + rows)))
    with pytest.raises(ValueError, match="num_heads: expected a multiple of the mask's 2 heads, got 3"):
        fa4_block_sparsity_consecutive(m.to(device), 8, 16, 3, 0, 70)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("entries,rep", [(1, 1), (3, 1), (2, 2)])
def test_cost_order_runs_every_block_of_every_head_once_heavy_buckets_first(family, entries, rep):
    """The CTA order of the cost-ordered schedule, decoded as the kernel does: every (kernel block,
    head-batch entry) exactly once; buckets of visited tiles (from the dense picture) never lighter
    before heavier; within a bucket one entry after the other, its blocks heaviest first."""
    from fm_parallel.kernels.fa4.sparsity import cost_order
    from fm_parallel.kernels.plan import launch_items

    m = FAMILIES[family]
    fwd, bwd = fa4_block_sparsity(m, 16, 8)
    want = expected(m, torch.arange(m.num_rows), 16, 8)
    heads = m.batch * m.heads
    visited_fwd, visited_bwd = (want != TileClass.SKIP).sum((0, 1, 3)), (want != TileClass.SKIP).sum((0, 1, 2))
    for lists, visited in ((fwd, visited_fwd), (bwd, visited_bwd)):
        blocks = len(visited)
        num_block = blocks * rep - (rep > 1)  # a ragged last list block: its second half is no kernel block
        items = launch_items(cost_order(lists), entries, num_block, rep)
        assert len(items) == blocks * entries * rep
        real = [it for it in items if it != (-1, -1)]
        assert sorted(real) == [(b, e) for b in range(num_block) for e in range(entries)]
        bucket = [math.floor(math.log2(max(float(visited[b // rep]) / heads, 1.0))) for b, _ in real]
        assert bucket == sorted(bucket, reverse=True), (family, bucket)
        for i in range(1, len(real)):
            if bucket[i] == bucket[i - 1] and real[i][1] == real[i - 1][1]:  # same bucket, same entry
                assert visited[real[i][0] // rep] <= visited[real[i - 1][0] // rep]
            elif bucket[i] == bucket[i - 1]:  # the next entry starts once the previous one ran the bucket
                assert real[i][1] == real[i - 1][1] + 1


def test_cost_order_puts_the_heavy_blocks_of_global_rows_and_sinks_first():
    """Global rows (query block 0 reads every key) lead the forward; attention sinks (key block 0 is
    read by every row) lead the backward; the last rows of a causal mask lead its forward."""
    from fm_parallel.kernels.fa4.sparsity import cost_order
    from fm_parallel.kernels.plan import launch_items

    n = 4096
    window = masks.sliding_window(n, 128, sinks=4)
    glob = masks.union(window, FlashMask(torch.zeros(n, dtype=torch.int32), torch.full((n,), 3, dtype=torch.int32)))
    fwd, _ = fa4_block_sparsity(glob, 128, 128)
    assert [b for b, _ in launch_items(cost_order(fwd), 4, 32)[:4]] == [0, 0, 0, 0]  # every head's global rows first
    _, bwd = fa4_block_sparsity(window, 128, 128)
    assert [b for b, _ in launch_items(cost_order(bwd), 4, 32)[:4]] == [0, 0, 0, 0]
    causal_fwd, _ = fa4_block_sparsity(masks.causal(n), 128, 128)
    assert launch_items(cost_order(causal_fwd), 1, 32)[0] == (31, 0)
