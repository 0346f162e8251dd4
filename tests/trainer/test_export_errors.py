"""``python -m fm_parallel.trainer.export`` on checkpoints it cannot read: one ``error:`` line naming
the checkpoint and what is wrong with it, exit status 2, never a traceback (issue 35.4)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.hidden_size", "32", "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1",
        "--model.intermediate_size", "64", "--model.lora_rank", "2", "--data.seq_len", "64", "--training.steps", "1",
        "--training.warmup", "0", "--training.loss_chunk", "64", "--parallel.cp", "none", "--output.checkpoint_every", "1"]


@pytest.fixture(scope="module")
def older_run(tmp_path_factory):
    """A finished one-step run whose checkpoint lost its checksums.json, as an older version wrote it."""
    out = tmp_path_factory.mktemp("export") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_")}
    proc = subprocess.run([sys.executable, "-m", "fm_parallel.launch", *TINY, "--output.dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "checkpoints" / "step_000001" / "checksums.json").unlink()
    return out


def _copy(run: Path, dest: Path) -> tuple[Path, Path]:
    shutil.copytree(run, dest)
    return dest, dest / "checkpoints" / "step_000001"


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def test_a_truncated_shard_without_checksums_is_one_error_line_through_the_command(older_run, tmp_path):
    run, ckpt = _copy(older_run, tmp_path / "run")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "fm_parallel.trainer.export", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = _one_error_line(proc.stderr)
    assert f"checkpoint: {ckpt} cannot be loaded (EOFError" in line and "no checksums.json" in line, line
    assert not (ckpt / "adapter_new").exists() and proc.stdout == ""


def test_the_other_unreadable_checkpoints_are_one_error_line_each(older_run, tmp_path, capsys):
    """The siblings, through the command's main() in this process (one import of transformers): a
    truncated or missing .metadata (dcp logs two tracebacks of its own fallback before failing), a
    checkpoint of another adapter shape than run.json says, a fine-tuned base folder gone, a damaged
    checkpoint named as the export command's 'checkpoint' (not the trainer's --resume), a damaged
    run.json, an --out that cannot be written."""
    from fm_parallel.trainer import export, runs

    def error(*argv) -> str:
        with pytest.raises(SystemExit) as exit_:
            export.main([str(a) for a in argv])
        assert exit_.value.code == 2
        return _one_error_line(capsys.readouterr().err)

    run, ckpt = _copy(older_run, tmp_path / "meta")
    (ckpt / ".metadata").write_bytes((ckpt / ".metadata").read_bytes()[:100])
    assert f"checkpoint: {ckpt} cannot be loaded (UnpicklingError: pickle data was truncated)" in error(run)
    (ckpt / ".metadata").unlink()
    assert f"checkpoint: {ckpt} cannot be loaded (FileNotFoundError" in error(run)

    run, ckpt = _copy(older_run, tmp_path / "shape")
    saved = json.loads((run / "run.json").read_text())
    saved["model"]["lora_rank"] = 8
    (run / "run.json").write_text(json.dumps(saved))
    assert f"checkpoint: {ckpt} cannot be loaded (" in error(run)

    run, ckpt = _copy(older_run, tmp_path / "base")
    saved["model"]["lora_rank"], saved["model"]["path"] = 2, str(tmp_path / "gone")
    (run / "run.json").write_text(json.dumps(saved))
    assert "model.path: the run fine-tuned" in error(run)

    run, ckpt = _copy(older_run, tmp_path / "sums")
    runs.write_checksums(ckpt)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    assert error(run).startswith(f"error: checkpoint: {shard} does not match its checksum")

    run, ckpt = _copy(older_run, tmp_path / "json")
    (run / "run.json").write_text("[1, 2]")
    assert "run_dir: " in error(run) and "cannot be exported" in error(run)

    (tmp_path / "file").write_text("")
    assert error(older_run, "--out", tmp_path / "file" / "adapter").startswith("error: --out: cannot write the adapter")


def test_resume_from_an_unreadable_shard_is_one_error_line(older_run, tmp_path):
    """The trainer's ``--resume`` on a checkpoint whose checksums match bytes dcp cannot read: dcp's
    ``CheckpointException`` is a ``BaseException``, which resume's ``except Exception`` let through as a
    traceback from every rank."""
    from fm_parallel.trainer import runs

    run, ckpt = _copy(older_run, tmp_path / "run")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    runs.write_checksums(ckpt)  # signed after the damage: the bytes verify, dcp cannot read them
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_")}
    proc = subprocess.run([sys.executable, "-m", "fm_parallel.launch", *TINY, "--training.steps", "2", "--training.reschedule", "true", "--output.dir",
                           str(run), "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = _one_error_line(proc.stderr)
    assert f"--resume: {ckpt} cannot be loaded (EOFError" in line and "truncated" in line, line
