"""Ulysses (all-to-all over heads) and hybrid ring x Ulysses on gloo, against the single process.

One spawn per world size (module fixtures): the 4-rank one also runs the hybrid 2 x 2 grid, the
2-rank one the head count Ulysses refuses.
"""

import pytest
import torch

from tests.distributed.spawn import raised, run_cases

N, D = 96, 8


def _masks():
    from fm_parallel import FlashMask, masks
    from tests.helpers import random_intervals

    per_kv = FlashMask(*random_intervals(1, 2, N, N, 3, seed=5)[:2], N)
    per_q = FlashMask(*random_intervals(1, 4, N, N, 2, seed=6)[:2], N)
    return {
        "docs": masks.document([30, 0, 40, 26]),
        "dpo": masks.dpo(40, 28, 28),
        "sliding_sinks": masks.sliding_window(N, 10, sinks=2),
        "per_kv_head": per_kv,
        "per_q_head": per_q,
    }


def _errors(out, q, k, v, ql, kl, vl, ref, plan, rank, dout):
    out.backward(plan.shard(dout, rank, 2))
    return {
        "out": (out - plan.shard(ref.detach(), rank, 2)).abs().max().item(),
        "dq": (ql.grad - plan.shard(q.grad, rank, 2)).abs().max().item(),
        "dk": (kl.grad - plan.shard(k.grad, rank, 2)).abs().max().item(),
        "dv": (vl.grad - plan.shard(v.grad, rank, 2)).abs().max().item(),
    }


def _inputs(hkv, name, mask):
    from fm_parallel import flashmask_attention

    torch.manual_seed(len(name))
    q = torch.randn(1, 4, N, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, N, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, N, D, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 4, N, D, dtype=torch.float64)
    ref = flashmask_attention(q, k, v, mask=mask, impl="torch")
    ref.backward(dout)
    return q, k, v, dout, ref


def ulysses_cases(rank, world):
    from fm_parallel.distributed import shard, ulysses_attention

    results = {}
    for name, mask in _masks().items():
        for hkv in (2, 1) if name != "per_kv_head" else (2,):
            q, k, v, dout, ref = _inputs(hkv, name, mask)
            for balance in ("contiguous", "zigzag", "mask"):
                plan = shard(mask, world, balance)
                ql, kl, vl = (plan.shard(t.detach(), rank, 2).requires_grad_() for t in (q, k, v))
                out = ulysses_attention(ql, kl, vl, mask, plan)
                results[f"{name}/hkv{hkv}/{balance}"] = _errors(out, q, k, v, ql, kl, vl, ref, plan, rank, dout)
    return results


def hybrid_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fm_parallel.distributed import RingStats, hybrid_attention, shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    results = {}
    for name, mask in _masks().items():
        q, k, v, dout, ref = _inputs(2, name, mask)
        for balance in ("contiguous", "mask"):
            plan = shard(mask, world, balance)
            ql, kl, vl = (plan.shard(t.detach(), rank, 2).requires_grad_() for t in (q, k, v))
            stats = RingStats()
            out = hybrid_attention(ql, kl, vl, mask, plan, mesh, stats=stats)
            errs = _errors(out, q, k, v, ql, kl, vl, ref, plan, rank, dout)
            results[f"{name}/{balance}"] = dict(errs, skipped=stats.transfers_skipped)
    return results


@pytest.fixture(scope="module")
def two_ranks():
    return run_cases(2, {"ulysses": (ulysses_cases, ()), "bad_heads": (bad_heads, ())})


@pytest.fixture(scope="module")
def four_ranks():
    return run_cases(4, {"ulysses": (ulysses_cases, ()), "hybrid": (hybrid_cases, ())})


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ulysses_results(request):
    return request.param, request.getfixturevalue("two_ranks" if request.param == 2 else "four_ranks")["ulysses"]


def _check(results, key):
    for rank, res in enumerate(results):
        assert "exception" not in res, res.get("traceback")
        for name in ("out", "dq", "dk", "dv"):
            assert res[key][name] < 1e-10, f"rank {rank} {key}: {name} differs by {res[key][name]}"


@pytest.mark.parametrize("mask_name", ["docs", "dpo", "sliding_sinks", "per_kv_head", "per_q_head"])
def test_ulysses_matches_single_process(ulysses_results, mask_name):
    world, results = ulysses_results
    keys = [k for k in results[0] if k.startswith(mask_name + "/")]
    assert keys
    for key in keys:  # includes H_kv = 1 < P (K/V heads replicated) and every balance mode
        _check(results, key)


def test_hybrid_2x2_matches_single_process(four_ranks):
    results = four_ranks["hybrid"]
    for key in results[0] if "exception" not in results[0] else []:
        _check(results, key)
    assert "exception" not in results[0], results[0].get("traceback")
    assert any(res["docs/contiguous"]["skipped"] > 0 for res in results)  # the outer ring still skips


def bad_heads(rank, world):
    from fm_parallel import masks
    from fm_parallel.distributed import shard, ulysses_attention

    mask = masks.causal(32)
    x = torch.randn(1, 3, 32 // world, 8)  # 3 heads over 2 ranks
    return raised(lambda: ulysses_attention(x, x, x, mask, shard(32, world, "contiguous")))


def test_heads_not_divisible_raise_naming_both_numbers(two_ranks):
    for res in two_ranks["bad_heads"]:
        assert res["raised"] and "ValueError" in res["raised"] and "divisible by the Ulysses degree 2, got 3 heads" in res["raised"], res
