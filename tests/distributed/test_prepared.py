"""The prepared mask of a step (fm_parallel/distributed/prepared.py): made once, reused by every layer
of ring, Ulysses and hybrid, forward and backward, with the same results as a bare mask per call;
collective and checked like a call (ranks that disagree all raise); and the host-staged transport
that lets P processes share one GPU over gloo.

Every case on 2 ranks runs in one spawn and the hybrid cases in one 4-rank spawn (module fixtures);
each test reads its own case's results.
"""

import pytest
import torch

from tests.distributed.spawn import run_cases

N, HQ, HKV, D = 96, 4, 2, 8
LAYERS = 3


def _data(seed=0):
    torch.manual_seed(seed)
    q = torch.randn(1, HQ, N, D, dtype=torch.float64)
    k = torch.randn(1, HKV, N, D, dtype=torch.float64)
    v = torch.randn(1, HKV, N, D, dtype=torch.float64)
    return q, k, v, torch.randn(1, HQ, N, D, dtype=torch.float64)


def _mask():
    from fm_parallel import masks

    return masks.union(masks.document([20, 40, 36]), masks.sliding_window(N, 6, sinks=2))


def layers_on_one_prepared_mask(rank, world, mode, balance):
    """LAYERS layers (forward + backward) on one prepared mask: each matches the single-process
    reference, and only the first layer builds column masks or runs the agreement."""
    from torch.distributed.device_mesh import init_device_mesh

    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import RingStats, hybrid_attention, prepare, ring_attention, shard, ulysses_attention

    mask = _mask()
    q, k, v, dout = _data()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = flashmask_attention(qr, kr, vr, mask=mask, impl="torch")
    ref.backward(dout)
    plan = shard(mask, world, balance)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses")) if mode == "hybrid" else None
    prepared = prepare(mask, plan, mesh=mesh) if mesh is not None else prepare(mask, plan)
    counters, errors = [], []
    for layer in range(LAYERS):
        ql, kl, vl = (plan.shard(t, rank, 2).clone().requires_grad_() for t in (q, k, v))
        stats = RingStats()
        if mode == "ring":
            out = ring_attention(ql, kl, vl, prepared, plan, stats=stats)
        elif mode == "ulysses":
            out = ulysses_attention(ql, kl, vl, prepared)
        else:
            out = hybrid_attention(ql, kl, vl, prepared, None, mesh, stats=stats)
        out.backward(plan.shard(dout, rank, 2))
        worst = max((a - plan.shard(b, rank, 2)).abs().max().item()
                    for a, b in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)))
        errors.append(worst)
        inner = prepared.derived(("hybrid", HQ, HKV, 1, torch.device("cpu")), lambda: None) if mode == "hybrid" else None
        counters.append({"agreements": prepared.counters["agreements"],
                         "columns": (inner[0] if inner else prepared).counters["columns"]})
    return {"errors": errors, "counters": counters}


BALANCES = ["contiguous", "zigzag", "mask"]
MISUSES = [
    ("mask", "mask: expected the same value on every rank"),
    ("plan", "plan: expected the plan the mask was prepared with"),
    ("bad_mask", "mask: expected a FlashMask with 96 key columns (the plan's N), got 98"),
    ("edited", "mask: changed in place after it was prepared"),
]


@pytest.fixture(scope="module")
def two_ranks():
    cases = {f"layers/{mode}/{balance}": (layers_on_one_prepared_mask, (mode, balance))
             for mode in ("ring", "ulysses") for balance in BALANCES}
    cases.update({f"misused/{what}": (prepared_then_misused, (what,)) for what, _ in MISUSES})
    cases["staged"] = (staged_ring, ())
    cases["context"] = (context_parallel_prepares_once_per_mask, ())
    return run_cases(2, cases, timeout=400)


@pytest.fixture(scope="module")
def four_ranks():
    return run_cases(4, {f"layers/hybrid/{balance}": (layers_on_one_prepared_mask, ("hybrid", balance)) for balance in BALANCES},
                     timeout=300)


@pytest.mark.parametrize("mode,world", [("ring", 2), ("ulysses", 2), ("hybrid", 4)])
@pytest.mark.parametrize("balance", BALANCES)
def test_every_layer_reuses_the_prepared_mask_and_matches_one_process(mode, world, balance, request):
    spawned = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    for rank, res in enumerate(spawned[f"layers/{mode}/{balance}"]):
        assert "exception" not in res, res.get("traceback")
        assert max(res["errors"]) < 1e-10, (rank, res["errors"])
        first, *later = res["counters"]
        assert first["agreements"] == 1, first
        assert all(c == first for c in later), res["counters"]  # no new agreement, no new column mask


def prepared_then_misused(rank, world, what):
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, ring_attention, shard
    from tests.distributed.test_agreement import _outcome

    mask = _mask()
    plan = shard(mask, world, "contiguous")
    q, k, v, _ = _data()
    ql, kl, vl = (plan.shard(t, rank, 2) for t in (q, k, v))
    if what == "mask":  # rank 1 prepares another packing: every rank raises at prepare, nobody hangs
        mine = masks.document([30, 30, 36]) if rank == 1 else mask
        return _outcome(lambda: prepare(mine, plan))
    if what == "plan":  # a call with another plan than the one prepared: every rank raises at the call
        prepared = prepare(mask, plan)
        other = shard(mask, world, "zigzag")
        return _outcome(lambda: ring_attention(ql, kl, vl, prepared, other if rank == 0 else plan))
    if what == "edited":  # the mask edited in place after prepare(): the next call raises, not stale columns
        mine = _mask()
        prepared = prepare(mine, plan)
        ring_attention(ql, kl, vl, prepared)  # a first layer runs
        mine.fme[..., :8, :] = mine.fms[..., :8, :]  # keys 0..7: seen by their own row only
        return _outcome(lambda: ring_attention(ql, kl, vl, prepared))
    if what == "bad_mask":  # rank 0's mask has the wrong length: its problem reaches every rank
        mine = masks.causal(N + 2) if rank == 0 else mask
        return _outcome(lambda: prepare(mine, plan))
    raise AssertionError(what)


@pytest.mark.parametrize("what,expected", MISUSES)
def test_prepare_and_prepared_calls_fail_on_every_rank_alike(two_ranks, what, expected):
    results = two_ranks[f"misused/{what}"]
    assert all(r["error"] is not None and expected in r["error"] for r in results), results
    assert results[0]["error"].split(": ", 2)[-1] == results[1]["error"].split(": ", 2)[-1]


def staged_ring(rank, world):
    """The ring with every transfer staged through host buffers (what gloo does for GPU tensors),
    forced on CPU tensors here: the received chunks and returned gradients must be the same."""
    from fm_parallel.distributed import comm

    staged = {"n": 0}

    def always(self, sends, recvs):
        staged["n"] += 1
        return True

    real = comm.RingComm.host_staged
    comm.RingComm.host_staged = always
    try:
        return _staged_ring(rank, world, staged)
    finally:  # the next case in this spawn sends as usual
        comm.RingComm.host_staged = real


def _staged_ring(rank, world, staged):
    from fm_parallel import flashmask_attention
    from fm_parallel.distributed import prepare, ring_attention, shard, ulysses_attention

    mask = _mask()
    q, k, v, dout = _data(3)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = flashmask_attention(qr, kr, vr, mask=mask, impl="torch")
    ref.backward(dout)
    out = {}
    for name, call in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        plan = shard(mask, world, "zigzag")
        ql, kl, vl = (plan.shard(t, rank, 2).clone().requires_grad_() for t in (q, k, v))
        o = call(ql, kl, vl, prepare(mask, plan), plan)
        o.backward(plan.shard(dout, rank, 2))
        out[name] = max((a - plan.shard(b, rank, 2)).abs().max().item()
                        for a, b in ((o, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)))
    out["staged_exchanges"] = staged["n"]
    return out


def test_host_staged_transfers_give_the_same_results(two_ranks):
    for res in two_ranks["staged"]:
        assert "exception" not in res, res.get("traceback")
        assert res["ring"] < 1e-10 and res["ulysses"] < 1e-10, res
        assert res["staged_exchanges"] > 0


def context_parallel_prepares_once_per_mask(rank, world):
    """ContextParallel (what the HF backend and the trainer call per layer) prepares a FlashMask once:
    the same object in every layer reuses it; a new mask object (next step) or an in-place edit does not."""
    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel

    mask = _mask()
    plan = shard(mask, world, "mask")
    ctx = ContextParallel("ring", plan)
    q, k, v, _ = _data()
    ql, kl, vl = (plan.shard(t, rank, 2) for t in (q, k, v))
    seen = []
    for _ in range(3):
        ctx.attention(ql, kl, vl, mask)
        seen.append(ctx.prepared)
    nxt = masks.document([20, 40, 36])
    ctx.attention(ql, kl, vl, nxt)
    seen.append(ctx.prepared)
    nxt.fme.add_(0)  # an in-place edit: the prepared data may be stale
    ctx.attention(ql, kl, vl, nxt)
    seen.append(ctx.prepared)
    # Identities taken while every prepared object is still held (a freed object's id can be reused).
    return {"seen": [[a is b for b in seen] for a in seen]}


def test_context_parallel_prepares_once_per_mask_object(two_ranks):
    for res in two_ranks["context"]:
        assert "exception" not in res, res.get("traceback")
        same = res["seen"]
        assert same[0][1] and same[0][2], same  # one prepared mask for the same object, layer after layer
        assert not same[0][3] and not same[0][4] and not same[3][4], same  # a new object, an in-place edit: new ones


def test_a_prepared_mask_knows_the_masks_it_was_made_from():
    """What ContextParallel asks to reuse a step's prepared mask: the same object as the mask given or
    its device copy (not an equal mask), each with its bounds unedited since."""
    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.prepared import PreparedMask
    from fm_parallel.masks.flashmask import FlashMask

    host = masks.document([20, 40, 36])
    plan = shard(host, 2, "zigzag")
    copy = FlashMask(host.fms.clone(), host.fme.clone(), host.num_rows)  # stands in for the device copy
    prepared = PreparedMask(copy, plan, 0, torch.device("cpu"), host_mask=host)
    assert prepared.made_from(host) and prepared.made_from(copy)
    assert not prepared.made_from(masks.document([20, 40, 36])) and not prepared.made_from(prepared)
    host.fme.add_(0)  # an in-place edit of the one given: its prepared data may be stale
    assert not prepared.made_from(host) and prepared.made_from(copy)


def test_prepare_refuses_bad_arguments_without_a_process_group():
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, shard

    with pytest.raises(ValueError, match="group: expected an initialised torch.distributed process group"):
        prepare(masks.causal(8), shard(8, 2, "contiguous"))
    with pytest.raises(ValueError, match="mask: expected a FlashMask, got Tensor"):
        prepare(torch.zeros(8), shard(8, 2, "contiguous"))
    with pytest.raises(ValueError, match="plan: expected a ShardPlan, got int"):
        prepare(masks.causal(8), 2)


def test_local_rows_rewrites_intervals_exactly():
    """Column masks in a rank's local rows: the same pictures as the global mask restricted to the
    rank's rows, for every balance mode and a mask with several intervals per column."""
    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.prepared import local_rows

    mask = masks.union(masks.document([20, 40, 36], causal=False), masks.sliding_window(N, 6, sinks=2),
                       masks.prefix_lm(N, 10))
    for balance in ("contiguous", "zigzag", "mask"):
        plan = shard(mask, 4, balance)
        for r in range(4):
            rows = plan.positions[r]
            for j in range(4):
                cols = mask.select_keys(plan.positions[j])
                local = local_rows(cols, rows)
                assert local.num_rows == rows.numel()
                assert torch.equal(local.to_dense(), cols.to_dense(rows=rows)), (balance, r, j)
                assert bool((local.fms[local.fms > local.fme] == rows.numel()).all())  # canonical empties


def test_the_diagonal_chunk_of_packed_causal_documents_is_packed_causal_documents_in_local_rows():
    """What lets impl='cute' run FA4's varlen / causal kernels on a rank's own chunk under CP, for
    every balance mode: the diagonal chunk, made on the host, knows it is causal documents."""
    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.prepared import PreparedMask

    for mask in (masks.document([20, 40, 36]), masks.causal(N)):
        for balance in ("contiguous", "zigzag", "mask"):
            plan = shard(mask, 4, balance)
            for r in range(4):
                prepared = PreparedMask(mask, plan, r, torch.device("cpu"), host_mask=mask)
                docs = prepared.columns(r).causal_documents()
                assert docs is not None and sum(docs) == N // 4, (balance, r, docs)
    sliding = masks.sliding_window(N, 6)
    prepared = PreparedMask(sliding, shard(sliding, 4, "zigzag"), 1, torch.device("cpu"), host_mask=sliding)
    assert prepared.columns(1).causal_documents() is None


def test_prepared_mask_names_a_bad_rank_mask_or_plan_without_a_process_group():
    """Checked before anything is built (no group needed): the rank, the mask's columns and rows
    against the plan; prepare() names a wrong mask before the missing group."""
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, shard
    from fm_parallel.distributed.prepared import PreparedMask
    from fm_parallel.masks.flashmask import FlashMask

    mask = masks.causal(64)
    plan = shard(mask, 2, "contiguous")
    cpu = torch.device("cpu")
    for rank in (-1, 2, 1.0, True, "1"):
        with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 2\)"):
            PreparedMask(mask, plan, rank, cpu)
    assert PreparedMask(mask, plan, torch.tensor(1), cpu).rank == 1  # any int type (a 0-d tensor, numpy's)
    with pytest.raises(ValueError, match="mask: expected a FlashMask with 64 key columns"):
        PreparedMask(masks.causal(32), plan, 0, cpu)
    with pytest.raises(ValueError, match="plan: expected a ShardPlan"):
        PreparedMask(mask, [torch.arange(32)], 0, cpu)
    wide = FlashMask(mask.fms, mask.fme, 96)  # 96 query rows over 64 keys: not self-attention
    with pytest.raises(ValueError, match="self-attention mask of 64 rows"):
        PreparedMask(wide, plan, 0, cpu)
    with pytest.raises(ValueError, match="mask: expected a FlashMask with 64 key columns"):
        prepare(masks.causal(32), plan)
    with pytest.raises(ValueError, match="group: expected an initialised"):
        prepare(mask, plan)
