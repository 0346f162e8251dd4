"""Ring attention on gloo with 2 and 4 ranks against the single-process result.

Each rank's output and q/k/v gradients must equal the matching slice of one process computing the
whole sequence; the transfers each rank skips must equal the count derived from the dense mask.

One spawn per world size (module fixtures): on 2 ranks it also runs the Triton ring and the ranks
that disagree, each test reading its own case's results.
"""

import pytest
import torch

from tests.distributed.spawn import raised, run_cases

N, HQ, HKV, D = 128, 4, 2, 16
BALANCES = ["contiguous", "zigzag", "mask"]


def mask_families():
    from fm_parallel import masks

    return {
        "causal": masks.causal(N),
        "docs": masks.document([30, 0, 40, 20, 38]),
        "dpo": masks.dpo(60, 34, 34),
        "sliding_sinks": masks.sliding_window(N, 16, sinks=2),
        "prefix_lm": masks.prefix_lm(N, 32),
        "multi_interval": masks.union(masks.sliding_window(N, 8), masks.document([64, 64], causal=False)),
    }


def expected_skips(dense: torch.Tensor, positions, rank: int) -> int:
    """A plain ring sends 3 (P - 1) chunks per rank per call (K/V forward, K/V backward, dK/dV back)."""
    world = len(positions)
    need = [[bool(dense[positions[r]][:, positions[j]].any()) for j in range(world)] for r in range(world)]
    skips = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        skips += 2 * (not need[dst][rank]) + (not need[rank][src])
    return skips


def expected_bytes(dense: torch.Tensor, positions, rank: int, per_key: int) -> int:
    """Bytes a rank sends per call when only key windows travel: K and V forward and again backward to
    each rank that sees some of its keys, and dK, dV back to each rank whose keys it saw; each the
    window from the first to the last of the keys seen (``per_key``: bytes of one key's row of K, all
    heads)."""
    world = len(positions)

    def window(r, j):  # how many of j's keys (in j's order) lie between the first and last r sees
        seen = dense[positions[r]][:, positions[j]].any(0).nonzero().flatten()
        return int(seen.max() - seen.min() + 1) if seen.numel() else 0

    sent = 0
    for s in range(1, world):
        dst, src = (rank + s) % world, (rank - s) % world
        sent += 2 * 2 * per_key * window(dst, rank) + 2 * per_key * window(rank, src)
    return sent


def ring_cases(rank, world):
    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import RingStats, ring_attention, shard

    results = {}
    for name, mask in mask_families().items():
        torch.manual_seed(0)
        q = torch.randn(1, HQ, N, D, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, HKV, N, D, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, HKV, N, D, dtype=torch.float64, requires_grad=True)
        dout = torch.randn(1, HQ, N, D, dtype=torch.float64)
        ref = flashmask_attention(q, k, v, mask=mask, impl="torch")
        ref.backward(dout)
        for balance in BALANCES:
            plan = shard(mask, world, balance=balance)
            ql, kl, vl = (plan.shard(t.detach(), rank, dim=2).requires_grad_() for t in (q, k, v))
            stats = RingStats()
            out = ring_attention(ql, kl, vl, mask, plan, stats=stats)
            out.backward(plan.shard(dout, rank, dim=2))
            errs = {
                "out": (out - plan.shard(ref.detach(), rank, 2)).abs().max().item(),
                "dq": (ql.grad - plan.shard(q.grad, rank, 2)).abs().max().item(),
                "dk": (kl.grad - plan.shard(k.grad, rank, 2)).abs().max().item(),
                "dv": (vl.grad - plan.shard(v.grad, rank, 2)).abs().max().item(),
            }
            dense = mask.to_dense()[0, 0]
            results[f"{name}/{balance}"] = dict(
                errors=errs, skipped=stats.transfers_skipped, posted=stats.transfers_posted,
                expected_skipped=expected_skips(dense, plan.positions, rank),
                pairs=stats.visible_pairs, expected_pairs=int(dense[plan.positions[rank]].sum()),
                bytes=stats.bytes_sent, expected_bytes=expected_bytes(dense, plan.positions, rank, HKV * D * 8),
            )
    return results


@pytest.fixture(scope="module")
def two_ranks():
    cases = {"ring": (ring_cases, ()), "triton": (ring_triton_cases, ())}
    cases.update({fn.__name__: (fn, ()) for fn in (mismatched_lengths, mismatched_masks)})
    return run_cases(2, cases, timeout=400)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ring_results(request):
    if request.param == 2:
        return 2, request.getfixturevalue("two_ranks")["ring"]
    return 4, run_cases(4, {"ring": (ring_cases, ())})["ring"]


CASES = [f"{m}/{b}" for m in ["causal", "docs", "dpo", "sliding_sinks", "prefix_lm", "multi_interval"] for b in BALANCES]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_matches_its_slice_of_the_single_process_result(ring_results, case):
    world, results = ring_results
    for rank, res in enumerate(results):
        assert "exception" not in res, res.get("traceback")
        r = res[case]
        for name, err in r["errors"].items():
            assert err < 1e-10, f"rank {rank}/{world} {case}: {name} differs by {err}"
        assert r["skipped"] == r["expected_skipped"], f"rank {rank}: skipped {r['skipped']}, dense mask says {r['expected_skipped']}"
        assert r["posted"] + r["skipped"] == 3 * (world - 1)
        assert r["pairs"] == r["expected_pairs"]
        assert r["bytes"] == r["expected_bytes"], f"rank {rank}: sent {r['bytes']} bytes, the key windows are {r['expected_bytes']}"


def test_documents_skip_transfers_with_contiguous_shards(ring_results):
    world, results = ring_results
    # Contiguous shards of short packed documents: most ranks never see each other's keys.
    assert sum(res["docs/contiguous"]["skipped"] for res in results) > 0


def test_only_the_key_windows_travel(ring_results):
    """Packed documents on contiguous shards: a document crossing a boundary sends its part, not the
    whole N / P chunk (K/V forward and backward, dK/dV back)."""
    world, results = ring_results
    full_chunk = HKV * (N // world) * D * 8
    for rank, res in enumerate(results):
        r = res["docs/contiguous"]
        assert r["bytes"] < r["posted"] * 2 * full_chunk, (rank, r["bytes"], r["posted"])


def mismatched_lengths(rank, world):
    from fm_parallel import masks
    from fm_parallel.distributed import ring_attention, shard

    n = 64 if rank == 0 else 128  # rank 0 was given a different sequence
    mask = masks.causal(n)
    plan = shard(mask, world, balance="contiguous")
    q = torch.randn(1, 2, n // world, 8)
    return raised(lambda: ring_attention(q, q, q, mask, plan))


def mismatched_masks(rank, world):
    from fm_parallel import masks
    from fm_parallel.distributed import ring_attention, shard

    mask = masks.causal(64) if rank == 0 else masks.document([32, 32])
    plan = shard(64, world, balance="contiguous")
    q = torch.randn(1, 2, 64 // world, 8)
    return raised(lambda: ring_attention(q, q, q, mask, plan))


@pytest.mark.parametrize("fn, message", [(mismatched_lengths, "expected the same value on every rank"),
                                         (mismatched_masks, "mask: expected the same value on every rank")])
def test_ranks_that_disagree_raise_instead_of_hanging(two_ranks, fn, message):
    for res in two_ranks[fn.__name__]:
        assert res.get("raised") and "ValueError" in res["raised"] and message in res["raised"], res


def ring_triton_cases(rank, world):
    """The ring with the Triton kernels (the interpreter here), on the prepared mask's column masks in
    local rows: every balance mode takes the consecutive-row plans, cached on those masks. Two "layers" on one prepared mask: the second builds no
    plan, no column mask and runs no agreement."""
    from fm_parallel.kernels.triton import backend as triton_flashmask

    builds = {"plans": 0, "arbitrary_rows": 0}
    reals = {name: getattr(triton_flashmask, name) for name in ("build_plan", "build_plans_consecutive")}
    try:
        return _ring_triton(rank, world, triton_flashmask, reals, builds)
    finally:  # the next case in this spawn builds plans uncounted
        for name, real in reals.items():
            setattr(triton_flashmask, name, real)


def _ring_triton(rank, world, triton_flashmask, reals, builds):
    from fm_parallel import flashmask_attention, masks
    from fm_parallel.distributed import prepare, ring_attention, shard

    for name, real in reals.items():

        def counted(*a, _real=real, _name=name, **kw):
            builds["plans"] += 1
            builds["arbitrary_rows"] += _name == "build_plan"
            return _real(*a, **kw)

        setattr(triton_flashmask, name, counted)
    mask = masks.union(masks.document([30, 50, 48]), masks.sliding_window(N, 8))
    torch.manual_seed(1)
    q = torch.randn(1, HQ, N, D, requires_grad=True)
    k = torch.randn(1, HKV, N, D, requires_grad=True)
    v = torch.randn(1, HKV, N, D, requires_grad=True)
    dout = torch.randn(1, HQ, N, D)
    ref = flashmask_attention(q, k, v, mask=mask, impl="torch")
    ref.backward(dout)
    results = {}
    for balance in ("contiguous", "zigzag"):
        plan = shard(mask, world, balance=balance)
        prepared = prepare(mask, plan)
        per_layer = []
        for layer in range(2):
            before = (builds["plans"], prepared.counters["columns"], prepared.counters["agreements"])
            ql, kl, vl = (plan.shard(t.detach(), rank, dim=2).requires_grad_() for t in (q, k, v))
            out = ring_attention(ql, kl, vl, prepared, impl="triton")
            out.backward(plan.shard(dout, rank, dim=2))
            per_layer.append([a - b for a, b in zip((builds["plans"], prepared.counters["columns"],
                                                     prepared.counters["agreements"]), before)])
        results[f"{balance}/state"] = {"per_layer": per_layer, "arbitrary_rows": builds["arbitrary_rows"],
                                       "windows": [prepared.window(j) for j in range(world)]}
        results[balance] = {
            "out": (out - plan.shard(ref.detach(), rank, 2)).abs().max().item(),
            "dq": (ql.grad - plan.shard(q.grad, rank, 2)).abs().max().item(),
            "dk": (kl.grad - plan.shard(k.grad, rank, 2)).abs().max().item(),
            "dv": (vl.grad - plan.shard(v.grad, rank, 2)).abs().max().item(),
        }
    return results


def test_ring_with_triton_kernels_on_contiguous_and_zigzag_shards(two_ranks):
    pytest.importorskip("triton")
    for rank, res in enumerate(two_ranks["triton"]):
        assert "exception" not in res, res.get("traceback")
        for balance in ("contiguous", "zigzag"):
            for name, err in res[balance].items():
                assert err < 1e-4, f"rank {rank} {balance}: {name} differs by {err}"
            first, second = res[f"{balance}/state"]["per_layer"]
            assert first[0] > 0 and first[1] > 0 and first[2] == 1, first  # plans, column masks, one agreement
            assert second == [0, 0, 0], second  # the next layer reuses all of it
        # Column masks in local rows: every balance mode takes the consecutive-row plans, never the
        # arbitrary-row builder; and a neighbour's chunk runs on the rows that see it only.
        assert res["zigzag/state"]["arbitrary_rows"] == 0, res["zigzag/state"]
        assert any(w != [0, N // 2] for w in res["contiguous/state"]["windows"]), res["contiguous/state"]


def test_window_sums_round_once_and_touch_only_their_rows():
    """The ring's gradient sum (``_Sum``): the base part's rows that no window covers stay as they came,
    window rows are the float32 sum rounded once into bf16 (equal to the exact sum rounded once),
    overlapping windows share one float32 span, window parts are never written to; without a base,
    a float32 sum over all rows."""
    from fm_parallel.distributed.ring import _spans, _Sum

    assert _spans([(2, 6), (0, 3), (8, 10), (5, 5), (6, 8)]) == [(0, 6, 2), (6, 8, 1), (8, 10, 1)]
    torch.manual_seed(0)
    like = torch.empty(1, 2, 12, 4, dtype=torch.bfloat16)
    base = torch.randn(1, 2, 12, 4).to(torch.bfloat16)
    windows = [(0, 3), (2, 6), (8, 10)]
    parts = [torch.randn(1, 2, b - a, 4).to(torch.bfloat16) for a, b in windows]
    kept = [p.clone() for p in parts]
    exact = base.double()
    for (a, b), part in zip(windows, parts):
        exact[:, :, a:b] += part.double()
    for planned in (windows, None):
        total = _Sum(torch.float32, planned)
        first = base.clone()
        total.add(first, slice(0, 12), like)
        for (a, b), part in zip(windows, parts):
            total.add(part, slice(a, b), like)
        got = total.result(like)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exact.to(torch.bfloat16)), planned
        assert all(torch.equal(p, k) for p, k in zip(parts, kept))
        untouched = [r for r in range(12) if not any(a <= r < b for a, b in windows)]
        assert torch.equal(got[:, :, untouched], base[:, :, untouched])
        if planned is not None:  # the base is summed into in place (no full-size copy)
            assert got.data_ptr() == first.data_ptr()
    empty = _Sum(torch.float32, [])
    assert torch.equal(empty.result(like), torch.zeros_like(like))
