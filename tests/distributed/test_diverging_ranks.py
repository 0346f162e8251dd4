"""A rank that diverges *after* the step's first agreement (issue 35.1): at a later layer one rank
alone brings a new dtype, local length or head count, edits the prepared mask in place, names an
unknown kernel, passes another plan than the prepared one, another scale, or needs gradients its
peers do not. Every rank must raise the same ValueError in bounded time: never a hang (peers left in
a collective one rank never joins), never a result computed silently with the prepared plan.

One spawn per world size runs every divergence through every entry point in turn (ring, Ulysses,
ContextParallel, the bare-mask ring_attention / ulysses_attention on 2 ranks; ring, Ulysses, hybrid
2 x 2, ContextParallel over the grid and the bare-mask calls on 4), each after a first layer on
which all ranks agree, plus the same two layers without divergence (every kind still matches one
process). The ranks' deadline is 5 s and the spawn's 90 s: on code that hangs the test fails.
"""

import pytest
import torch

from tests.distributed.spawn import run_ranks

N, H, D = 32, 4, 8
RANK_DEADLINE_S = 5.0
KINDS = {2: ["ring", "ulysses", "context ring", "context ulysses", "bare ring", "bare ulysses"],
         4: ["ring", "ulysses", "hybrid", "context hybrid", "bare ring", "bare ulysses", "bare hybrid"]}
SCENARIOS = ["none", "dtype", "length", "heads", "edit", "impl", "plan one", "plan all", "scale", "gradients"]


def _layer(kind, q, k, v, mask_arg, plan, mesh, cp, impl="auto", call_plan=None, scale=None):
    from fm_parallel.distributed import hybrid_attention, ring_attention, ulysses_attention

    plan_arg = plan if call_plan is None else call_plan
    if kind.startswith("context"):
        cp.impl, cp.plan = impl, plan_arg  # what a user changes on the object between layers
        return cp.attention(q, k, v, mask_arg, scale=scale)
    if kind.endswith("ring"):
        return ring_attention(q, k, v, mask_arg, plan_arg, impl=impl, scale=scale)
    if kind.endswith("ulysses"):
        return ulysses_attention(q, k, v, mask_arg, plan_arg, impl=impl, scale=scale)
    return hybrid_attention(q, k, v, mask_arg, plan_arg, mesh, impl=impl, scale=scale)


def diverge(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fm_parallel import flashmask_attention, masks
    from fm_parallel.distributed import comm, prepare, shard
    from fm_parallel.distributed.context import ContextParallel

    comm.AGREEMENT_TIMEOUT_S = RANK_DEADLINE_S
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses")) if world == 4 else None
    plan, other_plan = shard(N, world, "contiguous"), shard(N, world, "zigzag")
    torch.manual_seed(0)
    full = [torch.randn(1, H, N, D) for _ in range(3)]
    outcomes = {}
    for scenario in SCENARIOS:
        for kind in KINDS[world]:
            mask = masks.document([5, 11, 16])
            ref = flashmask_attention(*full, mask=mask, impl="torch")
            cp = None
            if kind.startswith("context"):
                mode = kind.split()[1]
                cp = ContextParallel(mode, plan, mesh=mesh if mode == "hybrid" else None)
                mask_arg = mask  # ContextParallel prepares the FlashMask itself
            elif kind.startswith("bare"):
                mask_arg = mask  # prepared per call
            else:
                mask_arg = prepare(mask, plan, mesh=mesh) if kind == "hybrid" else prepare(mask, plan)
            q, k, v = (plan.shard(t, rank, 2) for t in full)
            impl, call_plan, scale, layer2_plan = "auto", None, None, plan
            try:
                _layer(kind, q, k, v, mask_arg, plan, mesh, cp)  # layer 1: every rank alike, agreed
                if scenario == "dtype" and rank == 0:
                    q, k, v = (t.double() for t in (q, k, v))
                elif scenario == "length" and rank == 0:
                    q, k, v = (torch.cat([t, t[:, :, :1]], dim=2) for t in (q, k, v))
                elif scenario == "heads" and rank == 0:
                    q, k, v = (torch.cat([t, t], dim=1) for t in (q, k, v))
                elif scenario == "edit" and rank == 0:
                    with torch.no_grad():
                        mask.fme[..., 0] -= 1  # still a valid mask (key 0 leaves row 4), but not the prepared one
                elif scenario == "impl" and rank == 0:
                    impl = "no-such-kernel"
                elif scenario == "plan one" and rank == 0:
                    call_plan = other_plan
                elif scenario == "plan all":
                    call_plan = layer2_plan = other_plan
                elif scenario == "scale" and rank == 0:
                    scale = 0.5
                elif scenario == "gradients" and rank == 0:
                    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
                if layer2_plan is not plan:  # the inputs follow the plan the call names
                    q, k, v = (layer2_plan.shard(t, rank, 2) for t in full)
                out = _layer(kind, q, k, v, mask_arg, plan, mesh, cp, impl=impl, call_plan=call_plan, scale=scale)
                error = (out - layer2_plan.shard(ref, rank, 2)).abs().max().item()
                outcomes[f"{scenario}/{kind}"] = f"ok {error:.1e}" if error < 1e-5 else f"WRONG by {error:.1e}"
            except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
                outcomes[f"{scenario}/{kind}"] = f"{type(e).__name__}: {e}"
    return outcomes


def expected(scenario, kind):
    """What every rank must say: an error's start (after 'ValueError: '), or 'ok' (matches one process)."""
    prepared_here = not kind.startswith(("bare", "context"))  # the caller passed a PreparedMask
    if scenario == "none":
        return "ok"
    if scenario == "edit":  # a PreparedMask knows it was edited; a FlashMask prepared per call differs from the peers'
        return "rank 0: mask: changed in place after it was prepared" if prepared_here else \
            "mask: expected the same value on every rank"
    if scenario in ("plan one", "plan all") and kind.startswith("bare"):
        # a bare mask is prepared with the plan the call names: all alike is simply that plan
        return "plan: expected the same value on every rank" if scenario == "plan one" else "ok"
    return {"dtype": "dtype: expected the same value on every rank, got ['float64', ",
            "length": f"rank 0: q, k, v: expected {N // 4 if 'hybrid' in kind else None}",
            "heads": "query heads: expected the same value on every rank, got ['8', ",
            "impl": "rank 0: impl: expected one of",
            "plan one": "rank 0: plan: expected the plan the mask was prepared with",
            "plan all": "rank 0: plan: expected the plan the mask was prepared with",
            "scale": "scale: expected the same value on every rank, got ['0.5', 'default'",
            "gradients": "gradients: expected the same value on every rank, got ['needed', 'none'"}[scenario]


def _check(world, results):
    for res in results:
        assert "exception" not in res, res.get("traceback")
    failures = []
    for scenario in SCENARIOS:
        for kind in KINDS[world]:
            key = f"{scenario}/{kind}"
            got = [r[key] for r in results]
            want = expected(scenario, kind)
            if scenario == "length":
                want = f"rank 0: q, k, v: expected {N // world} local tokens"
            if want == "ok":
                good = all(g.startswith("ok") for g in got)
            else:  # the same ValueError on every rank
                good = got[0].startswith("ValueError: " + want) and all(g == got[0] for g in got)
            if not good:
                failures.append((key, got))
    assert not failures, "\n".join(f"{key}: {got}" for key, got in failures)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_diverging_after_the_agreement_raises_the_same_error_on_every_rank(world):
    _check(world, run_ranks(diverge, world, timeout=90))
