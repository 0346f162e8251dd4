"""Context parallelism on GPUs: ``tests/gpu/multi_gpu.py`` under torchrun, every case against one device.

    python -m pytest -q -rs tests/gpu/test_multi_gpu.py    # on the H200 (4 ranks sharing it); NCCL on >= 2 GPUs

multi_gpu.py prints one PASS / FAIL line per (kernel, mode, mask family, balance) and checks on every
rank the output and gradients against its slice of one device, and the planner's skipped transfers
and bytes; its exit status is 1 if any case failed, and its JSON says which. The GPU tests run it as
the H200 sessions did (``--shared-gpu``: 4 ranks on one GPU over gloo; NCCL: one rank per GPU); the CPU
tests run the same script on gloo CPU ranks (small shapes), so it never reaches a GPU session broken.
Was ``launch/bench/verify_multi_gpu.py`` and its tests in tests/test_launch.py (issue 32.3).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import GPUS, needs_cuda, needs_gpus

SCRIPT = Path(__file__).with_name("multi_gpu.py")


def torchrun(world: int, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                           str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def passed(proc: subprocess.CompletedProcess, out: Path) -> list[dict]:
    """The cases of the run's JSON, after checking that every one passed and the run completed."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("verify_multi_gpu_*.json")
    data = json.loads(path.read_text())
    assert data["complete"] is True  # written after every case with False, and True at the end
    failed = [c for c in data["cases"] if not c["pass"]]
    assert not failed, failed
    return data["cases"]


@needs_cuda
def test_ranks_sharing_one_gpu_equal_one_gpu(tmp_path):
    """4 ranks on the one GPU (gloo, host-staged transfers): ring, Ulysses and hybrid, every family and
    balance, 32k and 128k, against one GPU (the H200 sessions' ``cp`` stage)."""
    cases = passed(torchrun(4, "--shared-gpu", "--ns", "32768", "131072", "--heads", "8", "--kv-heads", "2",
                            "--out", str(tmp_path), timeout=3600), tmp_path)
    assert {c["mode"] for c in cases} == {"ring", "ulysses", "hybrid"}


@needs_gpus(2)
def test_nccl_ranks_equal_one_gpu(tmp_path):
    cases = passed(torchrun(GPUS, "--out", str(tmp_path), timeout=3600), tmp_path)
    assert {"ring", "ulysses"} <= {c["mode"] for c in cases}


@needs_gpus(2)
def test_the_ring_as_cuda_graphs_over_nccl_equals_one_gpu(tmp_path):
    passed(torchrun(GPUS, "--cuda-graphs", "--out", str(tmp_path), timeout=3600), tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_the_script_passes_on_cpu_ranks(tmp_path, world):
    proc = torchrun(world, "--device", "cpu", "--ns", "192", "--heads", "8", "--kv-heads", "2", "--head-dim", "8",
                    "--dtype", "float64", "--masks", "docs", "sliding_sinks", "--balances", "zigzag", "mask",
                    "--out", str(tmp_path), timeout=300)
    cases = passed(proc, tmp_path)
    assert (tmp_path / f"verify_multi_gpu_cpu_x{world}.json").exists()
    modes = {c["mode"] for c in cases}
    assert modes == ({"ring", "ulysses", "hybrid"} if world == 4 else {"ring", "ulysses"})
    assert len(cases) == 2 * 2 * len(modes)
    ring = [r for c in cases if c["mode"] == "ring" for r in c["ranks"]]
    assert all(r["skipped"] == r["expected_skipped"] for r in ring) and any(r["skipped"] for r in ring)
    assert all(r["bytes_sent"] == r["expected_bytes"] for r in ring)  # the key windows, checked by the script too


@pytest.mark.parametrize("where", [["--device", "cpu"], ["--shared-gpu"]])
def test_cuda_graphs_are_refused_without_nccl(tmp_path, where):
    """--cuda-graphs needs NCCL ranks: on CPU ranks or ranks sharing a GPU over gloo it stops at once,
    naming the flag, before any process group (no hang, no partial JSON)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), *where, "--cuda-graphs", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--cuda-graphs: expected NCCL ranks" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())
