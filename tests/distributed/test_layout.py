"""``fm_parallel.distributed.layout.CPLayout``, the CP layout of both front doors, on 2 and 4 gloo
ranks: where each rank sits, and ``cp_sum`` (forward: the group's sum; backward: the sum of the
group's gradients, as the replicated loss needs) without the FutureWarning that torch 2.13's
deprecated ``torch.distributed.nn.functional.all_reduce`` printed once per rank in every CP run."""

import warnings

import torch

from tests.distributed.spawn import run_ranks


def _sum(rank, world, mode, degree, ulysses):
    from fm_parallel.distributed.layout import CPLayout

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning, ours or torch's, fails the case
        lay = CPLayout(mode, degree, ulysses=ulysses)
        x = torch.tensor([float(rank + 1), 10.0 * (rank + 1)], dtype=torch.float64, requires_grad=True)
        y = lay.cp_sum(x)
        (y * (rank + 1)).sum().backward()  # each rank's own loss of the replicated sum
    return {"y": y.tolist(), "grad": x.grad.tolist(), "dp_rank": lay.dp_rank, "cp_rank": lay.cp_rank, "dp": lay.dp, "cp": lay.cp}


def test_cp_sum_sums_values_and_gradients_over_the_group_without_a_warning():
    for world, mode, degree, ulysses in ((2, "ring", 2, 1), (4, "hybrid", 4, 2), (4, "ulysses", 2, 2)):
        results = run_ranks(_sum, world, mode, degree, ulysses)
        for rank, res in enumerate(results):
            assert "exception" not in res, res
            group = [r for r in range(world) if r // degree == rank // degree]  # the ranks of this rank's CP group
            assert res["y"] == [sum(r + 1 for r in group), 10.0 * sum(r + 1 for r in group)], (world, mode, res)
            assert res["grad"] == [float(sum(r + 1 for r in group))] * 2, (world, mode, res)
            assert (res["dp"], res["cp"], res["dp_rank"], res["cp_rank"]) == (world // degree, degree, rank // degree, rank % degree)
