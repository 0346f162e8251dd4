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
