"""``python launch/train.py --nproc_per_node N``: the ranks started by torchrun's own launcher
(``torch.distributed.run``, gloo) with the trainer's exit status kept: a user error is one ``error:``
line, no traceback, status 2 (a bare ``torchrun`` turns any failed rank into its ChildFailedError
traceback and status 1; issue 31.7)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.hidden_size", "32", "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1",
        "--model.intermediate_size", "64", "--model.lora_rank", "2", "--data.seq_len", "64", "--training.steps", "1",
        "--training.warmup", "0", "--training.loss_chunk", "64", "--output.checkpoint_every", "0"]


def _train(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FM_", "OMP_")) and k not in ("RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _one_error(proc, message):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == f"error: {message}", proc.stderr[-3000:]


def test_a_user_error_through_the_launcher_is_one_line_and_status_2(tmp_path):
    # Found before any rank starts: nothing is spawned, nothing written.
    proc = _train("--nproc_per_node", "2", *TINY, "--training.grad_accum", "0", "--output.dir", str(tmp_path / "a"))
    _one_error(proc, "training.grad_accum: expected a value >= 1, got 0")
    assert "threads:" not in proc.stdout and not (tmp_path / "a").exists()
    # Found by the 2 gloo ranks (the row length against the CP degree): rank 0's line, status 2, no
    # torchrun report; the ranks got cores / ranks threads each, said once.
    proc = _train("--nproc_per_node=2", *TINY, "--parallel.cp", "ring", "--data.seq_len", "66",
                  "--output.dir", str(tmp_path / "b"))
    _one_error(proc, "data.seq_len: expected a multiple of 4 (CP degree 2, balance zigzag), got 66")
    assert "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr, proc.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert f"threads: {max(1, cores // 2)} per rank ({cores} cores / 2 ranks" in proc.stdout, proc.stdout[-2000:]
    assert _train("--nproc_per_node", "two", *TINY).returncode == 2


def test_threads_per_process_shares_the_cores():
    from fm_parallel.launch import threads_per_process

    assert [threads_per_process(n, cores=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_a_bad_data_line_through_the_readmes_command_is_the_last_line_a_user_reads(tmp_path):
    """The README's main job is ``python launch/train.py --nproc_per_node 2 ...`` (it was a bare torchrun,
    whose 30-line ChildFailedError report followed our line): a bad data line is found once, before
    any rank starts, and is the last line on the screen, status 2."""
    readme = (ROOT / "README.md").read_text()
    assert "&& python launch/train.py --nproc_per_node 2 --config launch/configs/cpu_sft.toml\n" in readme
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n' * 6 + '{"text": 7}\n')
    proc = _train("--nproc_per_node", "2", "--config", "launch/configs/cpu_sft.toml", "--data.path", str(data),
                  "--output.dir", str(tmp_path / "run"))
    message = (f"{data}:7: expected an SFT record of one of the formats {{\"text\": str}}; {{\"messages\": [{{\"role\", "
               f"\"content\"}}, ...]}}; {{\"prompt\", \"completion\"}} (strings, or message lists); got fields {{'text': 'a number'}}")
    _one_error(proc, message)
    assert proc.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert "ChildFailedError" not in proc.stderr and not (tmp_path / "run").exists()
