"""The trainer command's user errors: refused before anything is created, and on their own line
(issue 35.4)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.hidden_size", "32", "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1",
        "--model.intermediate_size", "64", "--model.lora_rank", "2", "--data.seq_len", "64", "--training.steps", "2",
        "--training.warmup", "0", "--training.loss_chunk", "64", "--parallel.cp", "none", "--output.checkpoint_every", "0"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_") and k != "TRITON_INTERPRET"}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def _shown_lines(stream: str) -> list[str]:
    """What a terminal shows: each line as its last carriage-return segment (a progress bar redraws with \\r)."""
    return [line.split("\r")[-1] for line in stream.split("\n")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_a_kernel_the_device_cannot_run_is_refused_before_anything_is_created(tmp_path):
    """--parallel.impl cute (or triton without the interpreter) on the CPU: one line, status 2, and no
    run directory (it used to be refused at the first forward, after run.json and base_model/)."""
    for impl in ("cute",):  # triton without TRITON_INTERPRET is refused the same way (one resolver)
        out = tmp_path / impl
        proc = subprocess.run([sys.executable, "-m", "fm_parallel.launch", *TINY, "--parallel.impl", impl,
                               "--output.dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr
        errors = [line for line in _shown_lines(proc.stderr) if "error:" in line]
        assert errors == [f"error: parallel.impl: {impl!r} needs CUDA tensors, got device cpu"], proc.stderr[-3000:]
        assert not out.exists()


def test_a_user_error_after_the_progress_bar_started_is_on_its_own_line(tmp_path, monkeypatch, capfd):
    """An error raised inside a step (here the update, replaced to raise) reaches the command's main()
    while rank 0's bar is drawn: the line starts on its own, never after the bar's text."""
    from fm_parallel.trainer import loop
    from fm_parallel.trainer.config import ConfigError

    def refuse(params, optim, max_norm):
        raise ConfigError("parallel.impl: refused inside a step")

    monkeypatch.setattr(loop, "update", refuse)
    monkeypatch.delenv("RANK", raising=False)
    for name in [k for k in os.environ if k.startswith("FM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit_:
        loop.main([*TINY, "--output.dir", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert "0/2" in err  # the bar was drawn first
    shown = [line for line in _shown_lines(err) if "error:" in line]
    assert shown == ["error: parallel.impl: refused inside a step"], repr(err[-2000:])


@pytest.mark.parametrize("through", ["launcher", "rank"])
def test_more_processes_than_gpus_are_refused_before_any_rank(tmp_path, monkeypatch, capsys, through):
    """A host with one GPU asked for 2 processes: each rank takes cuda:LOCAL_RANK, and the second died
    on "invalid device ordinal" while the first waited for it. Refused at once instead, naming the
    flag: by the launcher before any rank starts, or by each torchrun rank (LOCAL_WORLD_SIZE) before
    its process group, one line, status 2, nothing written. The GPU is stated (this runs on the CPU)."""
    from fm_parallel import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    if through == "launcher":
        argv = [*TINY, "--output.dir", str(out), "--nproc_per_node", "2"]
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # what torchrun sets in each rank
        argv = [*TINY, "--output.dir", str(out)]
    with pytest.raises(SystemExit) as stop:
        launch.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --nproc_per_node: expected at most 1 processes on this host (one GPU each), got 2; " \
           "CUDA_VISIBLE_DEVICES chooses the GPUs, and set empty runs every rank on the CPU" in err, err
    assert not out.exists()
