"""A user error under torchrun always shows its reason (fm_parallel/user_errors.py).

torchrun stops every rank as soon as one exits. These tests make one rank reach the error later than
the other (a stand-in ``tensorboard`` package that sleeps on one rank before refusing to import), the
race that once left a CI run with torchrun's report and no reason: rank 1 exited at once, rank 0 was
stopped before it printed."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fm_parallel.user_errors import exit_with_user_error, user_error_line

from tests.helpers import TINY

ROOT = Path(__file__).resolve().parents[1]
REASON = "logging.tensorboard: expected the 'tensorboard' package"


def test_the_line_names_the_rank_only_when_it_is_not_rank_0_of_several():
    assert user_error_line("x: bad", {}) == "error: x: bad"
    assert user_error_line("x: bad", {"RANK": "0", "WORLD_SIZE": "4"}) == "error: x: bad"
    assert user_error_line("x: bad", {"RANK": "3", "WORLD_SIZE": "4"}) == "error (rank 3): x: bad"
    assert user_error_line(ValueError("x: bad"), {"RANK": "1", "WORLD_SIZE": "1"}) == "error: x: bad"


@pytest.mark.parametrize("rank, waits", [("0", False), ("1", True)])
def test_a_rank_other_than_0_waits_before_it_prints_and_exits_with_status_2(monkeypatch, capsys, rank, waits):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    began = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        exit_with_user_error(ValueError("data.path: expected a file"), grace_s=0.5)
    assert exit_.value.code == 2
    assert (time.perf_counter() - began >= 0.5) == waits
    err = capsys.readouterr().err
    assert err == ("error (rank 1): data.path: expected a file\n" if waits else "error: data.path: expected a file\n")


def _torchrun(tmp_path, sleep_by_rank: dict[str, float]):
    """Two ranks of the trainer asked for TensorBoard, whose stand-in package sleeps
    ``sleep_by_rank[RANK]`` seconds, then refuses to import; (process, seconds it took)."""
    fake = tmp_path / "site" / "tensorboard"
    fake.mkdir(parents=True)
    fake.joinpath("__init__.py").write_text(
        "import os, time\n"
        f"time.sleep({sleep_by_rank!r}.get(os.environ.get('RANK'), 0.0))\n"
        "raise ImportError('no module named tensorboard (test)')\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29300 + os.getpid() % 90), "-m", "fm_parallel.launch", *TINY, "--logging.tensorboard", "true",
           "--output.dir", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return proc, time.perf_counter() - began


def _reasons(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error") and REASON in line]


def test_rank_0_reaching_the_error_after_rank_1_still_prints_it(tmp_path):
    proc, _ = _torchrun(tmp_path, {"0": 1.5})
    assert proc.returncode != 0
    # Rank 1 waits for rank 0 (PEER_GRACE_S) instead of exiting first and getting rank 0 stopped.
    assert [line for line in _reasons(proc.stderr) if line.startswith(f"error: {REASON}")], proc.stderr[-3000:]
    assert len(_reasons(proc.stderr)) == len(set(_reasons(proc.stderr))) <= 2, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_an_error_rank_0_does_not_reach_is_printed_by_the_rank_that_met_it(tmp_path):
    proc, seconds = _torchrun(tmp_path, {"0": 120.0})
    assert proc.returncode != 0
    assert [line for line in _reasons(proc.stderr) if line.startswith("error (rank 1): ")], proc.stderr[-3000:]
    assert not [line for line in _reasons(proc.stderr) if line.startswith("error: ")], proc.stderr[-3000:]
    assert seconds < 100, seconds  # rank 1 ended the job after its grace, not after rank 0's 120 s
