"""Ring and hybrid on random masks, against one process (float64, 4 gloo ranks).

The builders' masks give row windows of a few shapes; random bounds give all of them: chunks seen by
one row only, by rows at both ends of a rank's share (a window that spans holes), rows that see no key
at all (zero output, zero gradients), keys no row sees, several intervals per column. Every rank's
output and q/k/v gradients must equal its slice of the single-process result, and the transfers it
skips must be those the dense mask implies.
"""

import pytest
import torch

from tests.distributed.spawn import run_cases, run_ranks
from tests.distributed.test_ring import expected_skips

N, HQ, HKV, D = 96, 4, 2, 8
SEEDS = range(4)


def random_mask(seed: int, n: int = N):
    """Valid random bounds, ``[B = 1, Hm = 1]``. Even seeds: up to 3 sorted disjoint intervals per
    column anywhere (long intervals: windows near a rank's whole share, spanning holes); odd seeds:
    short intervals close to each column's own row (windows of a few rows, anywhere in a share).
    Either way a third of the columns are hidden (keys no row sees) and a stripe of rows sees no key
    (cutting an interval in two at most: 4 intervals, what a FlashMask holds)."""
    from fm_parallel import masks

    g = torch.Generator().manual_seed(seed)
    m = 1 + seed % 3
    if seed % 2 == 0:
        cuts = torch.randint(0, n + 1, (1, 1, n, 2 * m), generator=g)
    else:
        near = torch.arange(n).view(1, 1, n, 1)
        cuts = (near + torch.randint(-6, 7, (1, 1, n, 2 * m), generator=g)).clamp(0, n)
    cuts = torch.sort(cuts, dim=-1).values
    fms, fme = cuts[..., 0::2], cuts[..., 1::2] - 1  # [s, e) -> [s, e - 1]; s == e: an empty interval
    hidden = torch.rand(n, generator=g) < 0.33
    fms[..., hidden, :], fme[..., hidden, :] = n, -1
    keep = torch.ones(n, 1, dtype=torch.bool)
    keep[n // 2 - 4 + seed : n // 2 + 4 + seed] = False  # rows that see no key
    dense = masks.FlashMask(fms.int(), fme.int(), n).to_dense()[0, 0] & keep
    return masks.from_dense(dense), dense


def cases(rank, world, mode, impl="torch", seeds=tuple(SEEDS), n=N):
    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import RingStats, hybrid_attention, prepare, ring_attention, shard

    mesh = None
    if mode == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    results = {}
    dtype = torch.float64 if impl == "torch" else torch.float32  # the Triton kernels take no float64
    for seed in seeds:
        mask, dense = random_mask(seed, n)
        torch.manual_seed(seed)
        q = torch.randn(1, HQ, n, D, dtype=dtype, requires_grad=True)
        k = torch.randn(1, HKV, n, D, dtype=dtype, requires_grad=True)
        v = torch.randn(1, HKV, n, D, dtype=dtype, requires_grad=True)
        dout = torch.randn(1, HQ, n, D, dtype=dtype)
        ref = flashmask_attention(q, k, v, mask=mask, impl="torch")
        ref.backward(dout)
        for balance in ("contiguous", "zigzag", "mask"):
            plan = shard(mask, world, balance=balance)
            ql, kl, vl = (plan.shard(t.detach(), rank, dim=2).requires_grad_() for t in (q, k, v))
            stats = RingStats()
            if mode == "ring":
                prepared = prepare(mask, plan)
                out = ring_attention(ql, kl, vl, prepared, stats=stats, impl=impl)
                windows = [prepared.window(j) for j in range(world)]
            else:
                out = hybrid_attention(ql, kl, vl, mask, plan, mesh, stats=stats, impl=impl)
                windows = []
            out.backward(plan.shard(dout, rank, dim=2))
            blind = ~dense[plan.positions[rank]].any(1)  # this rank's rows that see nothing
            results[f"{seed}/{balance}"] = dict(
                errors={
                    "out": (out - plan.shard(ref.detach(), rank, 2)).abs().max().item(),
                    "dq": (ql.grad - plan.shard(q.grad, rank, 2)).abs().max().item(),
                    "dk": (kl.grad - plan.shard(k.grad, rank, 2)).abs().max().item(),
                    "dv": (vl.grad - plan.shard(v.grad, rank, 2)).abs().max().item(),
                },
                blind_rows=int(blind.sum()),
                blind_out=out.detach()[:, :, blind].abs().max().item() if blind.any() else 0.0,
                skipped=stats.transfers_skipped,
                expected_skipped=expected_skips(dense, plan.positions, rank) if mode == "ring" else None,
                narrow_windows=sum(0 < hi - lo < len(plan.positions[rank]) // 2 for lo, hi in windows),
            )
    return results


def check(results, mode, tol):
    blind = narrow = 0
    for rank, res in enumerate(results):
        assert "exception" not in res, res.get("traceback")
        for case, r in res.items():
            for name, err in r["errors"].items():
                assert err < tol, f"{mode} rank {rank} case {case}: {name} differs by {err}"
            assert r["blind_out"] == 0.0, f"{mode} rank {rank} case {case}: rows that see no key got output"
            blind += r["blind_rows"]
            narrow += r["narrow_windows"]
            if r["expected_skipped"] is not None:
                assert r["skipped"] == r["expected_skipped"], (rank, case, r["skipped"], r["expected_skipped"])
    assert blind > 0  # the cases did hold rows that see nothing
    return narrow


@pytest.fixture(scope="module")
def four_ranks():
    """Both modes in one 4-rank spawn."""
    return run_cases(4, {mode: (cases, (mode,)) for mode in ("ring", "hybrid")})


@pytest.mark.parametrize("mode", ["ring", "hybrid"])
def test_random_masks_match_one_process_on_every_rank(four_ranks, mode):
    narrow = check(four_ranks[mode], mode, 1e-10)
    if mode == "ring":
        assert narrow > 0  # chunks that ran on a few rows of a share


def test_random_masks_through_the_triton_kernels_windows_at_any_row():
    """The Triton kernels take a window's rows from its offset (the PyTorch path from the row list),
    so narrow windows away from row 0 are checked through them too (the interpreter here)."""
    pytest.importorskip("triton")
    narrow = check(run_ranks(cases, 2, "ring", "triton", (1, 3), 64), "ring/triton", 1e-4)
    assert narrow > 0
