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

    def refuse(params, optim):
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
