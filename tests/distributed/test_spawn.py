"""The rank harness: a rank that dies before reporting fails the test, it is never skipped over."""

import pytest

from tests.distributed.spawn import run_ranks


def dies_on_rank_1(rank, world):
    import os

    if rank == 1:
        os.abort()
    return {"ok": True}


def test_a_rank_that_dies_before_reporting_fails_the_run():
    with pytest.raises(RuntimeError, match="rank 1 wrote no result"):
        run_ranks(dies_on_rank_1, 2, timeout=120)


def dies_on_rank_1_while_rank_0_works(rank, world):
    import os
    import time

    if rank == 1:
        os.abort()
    time.sleep(5)  # still working when the harness stops it after rank 1's death
    return {"ok": True}


def test_ranks_stopped_after_another_rank_died_are_named_too():
    with pytest.raises(RuntimeError, match="rank 0 wrote no result; rank 1 wrote no result"):
        run_ranks(dies_on_rank_1_while_rank_0_works, 2, timeout=120)


def case_ok(rank, world):
    return {"rank": rank}


def case_raises_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1's own failure")
    return {"rank": rank}


def test_cases_in_one_spawn_keep_their_results_and_a_raising_case_stops_the_rest():
    from tests.distributed.spawn import run_cases

    got = run_cases(2, {"ok": (case_ok, ()), "raises": (case_raises_on_rank_1, ()), "after": (case_ok, ())}, timeout=120)
    assert got["ok"] == [{"rank": 0}, {"rank": 1}]
    assert got["raises"][0] == {"rank": 0}
    assert got["raises"][1]["exception"] == "ValueError: rank 1's own failure"
    assert all(r["exception"] == "not run: case raises raised on some rank" for r in got["after"]), got["after"]
