"""The benchmark runner (launch/bench/run.py): its catalogue, its table in the docs, its refusals, and
one CPU suite end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNER = [sys.executable, str(ROOT / "launch" / "bench" / "run.py")]


def runner(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RUNNER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_list_prints_every_benchmark_and_the_docs_hold_the_same_table():
    sys.path.insert(0, str(ROOT))
    from launch.bench.run import CATALOGUE, SUITES, table

    proc = runner("--list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == table()
    assert set(SUITES) == {"kernel", "trainer", "long-context", "cp", "cpu", "tune"}
    for b in CATALOGUE:
        assert (ROOT / "launch" / "bench" / b.script).is_file(), b
        assert f"| {b.suite} | {b.name} |" in proc.stdout
    assert table() in (ROOT / "docs" / "benchmarks" / "README.md").read_text(), \
        "docs/benchmarks/README.md: paste the output of `python -m launch.bench.run --list`"


def test_every_script_under_launch_bench_is_in_the_catalogue_or_a_helper():
    from launch.bench.run import CATALOGUE

    helpers = {"run.py", "harness.py"}
    scripts = {p.name for p in (ROOT / "launch" / "bench").glob("*") if p.is_file()}
    assert scripts - helpers == {b.script for b in CATALOGUE}


def test_a_dry_run_prints_the_documented_commands_and_torchrun_takes_nproc():
    proc = runner("--suite", "cp", "--dry-run", "--nproc", "4")
    assert proc.returncode == 0, proc.stderr
    assert "== cp-scaling: torchrun --nproc_per_node 4 -m launch.bench.cp_scaling" in proc.stdout
    assert "== ring-cpu: python -m launch.bench.ring_cpu" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--suite", "cp", "--", "--n", "4"], "arguments after --: expected one benchmark selected with --only, got 3"),
    (["--suite", "cp", "--only", "kernel"], "--only: expected benchmarks of suite 'cp'"),
    (["--suite", "gpu"], "argument --suite: invalid choice: 'gpu'"),
    ([], "--suite: expected one of kernel, trainer, long-context, cp, cpu, tune"),
    (["--suite", "cp", "--nproc", "0"], "--nproc: expected at least 1, got 0"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    proc = runner(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the skip on a machine without a GPU")
def test_a_gpu_suite_without_a_gpu_is_skipped_saying_so():
    proc = runner("--suite", "trainer")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "skipped trainer: needs 1 CUDA GPU(s), found 0" in proc.stdout
    assert "no benchmark of suite 'trainer' can run here" in proc.stderr


def test_the_cpu_suite_runs_end_to_end_and_writes_json_table_and_plot(tmp_path):
    proc = runner("--suite", "cpu", "--only", "cpu-attention", "--", "--n", "256", "--masks", "docs512", "--quick",
                  "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== cpu-attention: python -m launch.bench.cpu_attention --n 256" in proc.stdout
    data = json.loads((tmp_path / "cpu_attention.json").read_text())
    assert len(data["rows"]) == 4 and not [r for r in data["rows"] if "error" in r]  # 2 impls x fwd, fwd+bwd
    assert all(r["time_ms"] > 0 and "peak_mib" in r for r in data["rows"])
    assert (tmp_path / "cpu_attention.png").stat().st_size > 0
    assert "| docs512 | 256 | fwd |" in (tmp_path / "cpu_attention.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("script, on_a_cpu", [
    ("max_context.py", "on a CPU pass --device cpu"),
    ("train_context.py", "on a CPU pass --device cpu"),  # its trainer fell back to the CPU: rows of the wrong device
    ("cp_scaling.py", "on a CPU pass --device cpu (gloo)"),
    ("cp_layer_cost.py", "python -m launch.bench.ring_cpu"),
])
def test_the_gpu_scripts_refuse_their_default_device_without_cuda(script, on_a_cpu):
    """A script's default ``--device cuda`` on a machine without one: status 2 and one line saying
    what to run instead, not a traceback from inside torch (or a trainer silently on the CPU)."""
    proc = subprocess.run([sys.executable, "-m", f"launch.bench.{script[:-3]}"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{script}: error: --device cuda: expected a CUDA device" in proc.stderr and on_a_cpu in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_benchmark_run_as_a_file_says_how_to_run_it():
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "kernel.py")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and "python -m launch.bench.kernel" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("shared_gpu", [False, True])
def test_more_nccl_ranks_than_gpus_are_refused_before_the_process_group(monkeypatch, shared_gpu):
    """cp_scaling.py and tests/gpu/multi_gpu.py under torchrun with 2 ranks on a one-GPU host (stated):
    each NCCL rank takes cuda:LOCAL_RANK, and the second died on "invalid device ordinal". Refused by
    name before any process group; --shared-gpu (every rank on cuda:0) is what one GPU can run."""
    import torch.distributed as dist

    from launch.bench.harness import init_ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    started = []

    def init_process_group(*args, **kwargs):
        started.append(args)
        raise RuntimeError("stop here: the process group would start")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    if shared_gpu:
        with pytest.raises(RuntimeError, match="stop here"):
            init_ranks("cuda", shared_gpu=True)
        assert started == [("gloo",)]
        return
    with pytest.raises(ValueError, match=r"^--nproc_per_node: expected at most 1 ranks on this host with --device cuda "
                                         r"\(one GPU each\), got 2; --shared-gpu puts every rank on one GPU$"):
        init_ranks("cuda")
    assert not started
