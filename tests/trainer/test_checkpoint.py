"""Resuming through the trainer command (``fm_parallel.trainer.loop.main``, what launch/train.py runs):
a learning-rate schedule other than the checkpoint's is refused in one line naming each key and both
values, unless ``training.reschedule``; then one line says what changed."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = ["--model.hidden_size", "32", "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1",
        "--model.intermediate_size", "64", "--model.lora_rank", "2", "--data.seq_len", "64", "--parallel.cp", "none",
        "--training.warmup", "1", "--training.loss_chunk", "64", "--output.checkpoint_every", "1"]


def _run(argv, capsys):
    from fm_parallel.trainer.loop import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_resume_with_another_schedule_is_refused_unless_asked_for_then_said(tmp_path, capsys):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.optimizer import learning_rate

    out = tmp_path / "run"
    run = TINY + ["--output.dir", str(out)]
    code, _, err = _run(run + ["--training.steps", "3"], capsys)
    assert code in (0, None), err[-3000:]
    before = (out / "metrics.jsonl").read_text()

    # More steps (and another peak): refused, every changed key with both values, nothing trained.
    code, _, err = _run(run + ["--training.steps", "5", "--training.lr", "0.002", "--resume"], capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("error:")]
    assert "learning-rate schedule differs" in line and "training.steps: 3 -> 5; training.lr: 0.001 -> 0.002" in line, line
    assert "--training.reschedule true" in line, line
    assert (out / "metrics.jsonl").read_text() == before

    # Asked for: accepted, said in one line, and steps 3-4 follow the new schedule.
    argv = run + ["--training.steps", "5", "--training.reschedule", "true", "--resume"]
    code, stdout, err = _run(argv, capsys)
    assert code in (0, None), err[-3000:]
    notes = [x for x in stdout.splitlines() if "training.reschedule" in x]
    assert len(notes) == 1 and "training.steps: 3 -> 5" in notes[0] and "step 4" in notes[0], stdout[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(argv, environ={})
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]  # steps done, as the bar counts
    assert [r["learning_rate"] for r in records if r["step"] >= 4 and "learning_rate" in r] == [learning_rate(cfg, 3), learning_rate(cfg, 4)]
    # The checkpoints now carry the new schedule: resuming it again needs no key.
    code, stdout, err = _run(run + ["--training.steps", "5", "--resume"], capsys)
    assert code in (0, None) and "nothing to train" in stdout, err[-3000:]
