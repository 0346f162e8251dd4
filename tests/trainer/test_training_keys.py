"""The training keys HF Trainer / TRL users look for: ``training.scheduler`` is
``transformers.get_scheduler``'s step for step, ``weight_decay`` decays matrices only,
``max_grad_norm`` clips (0: never), ``epochs`` decides the steps from the rows of a pass,
``model.lora_dropout`` reaches peft, metrics carry HF's names (``learning_rate``, ``epoch``) and DPO logs
TRL's reward metrics every step; a bad value is one ``error:`` line, exit 2, nothing written."""

import json
import math

import pytest
import torch

from fm_parallel.trainer.config import load_config
from fm_parallel.trainer.optimizer import build_optimizer, learning_rate, update
from tests.trainer.test_model import _run

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = ["--model.hidden_size", "32", "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1",
        "--model.intermediate_size", "64", "--model.lora_rank", "2", "--data.seq_len", "128", "--training.loss_chunk", "64",
        "--parallel.cp", "none", "--output.checkpoint_every", "0", "--model.tile_chunk", "0"]


@pytest.mark.parametrize("scheduler, hf", [("cosine_with_min_lr", "cosine_with_min_lr"), ("cosine", "cosine"),
                                           ("linear", "linear"), ("constant", "constant_with_warmup")])
def test_the_schedule_is_transformers_get_scheduler_step_for_step(scheduler, hf):
    cfg = load_config(["--training.scheduler", scheduler, "--training.steps", "20", "--training.warmup", "4",
                       "--training.lr", "0.002"], environ={})
    param = torch.zeros(1, requires_grad=True)
    optim = torch.optim.AdamW([param], lr=0.002)
    sched = transformers.get_scheduler(hf, optim, num_warmup_steps=4, num_training_steps=20,
                                       scheduler_specific_kwargs={"min_lr_rate": 0.1} if hf == "cosine_with_min_lr" else None)
    theirs = []
    for _ in range(20):  # HF Trainer: the rate of step s is the scheduler's after s steps
        theirs.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    ours = [learning_rate(cfg, s) for s in range(20)]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert ours[0] == 0.0 and max(ours) == pytest.approx(0.002)


def test_weight_decay_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = load_config(["--training.weight_decay", "0.1"], environ={})
    _, optim = build_optimizer(model, cfg)
    decayed = {id(p) for g in optim.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in optim.param_groups) == 4


@pytest.mark.parametrize("max_norm, want", [(0.5, 0.5), (0.0, 5.0)])
def test_max_grad_norm_clips_and_zero_never_does(max_norm, want):
    import torch.distributed as dist

    p = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([3.0, 4.0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # update() sums over the world
    try:
        norm = update([p], optim, max_norm)
    finally:
        dist.destroy_process_group()
    assert norm == pytest.approx(5.0)
    assert torch.linalg.vector_norm(p.detach()).item() == pytest.approx(want)


@pytest.mark.parametrize("argv, message", [
    (["--training.scheduler", "polynomial"], "error: training.scheduler: expected cosine_with_min_lr, cosine, linear or "
                                             "constant, got 'polynomial'"),
    (["--training.weight_decay", "-0.1"], "error: training.weight_decay: expected a value >= 0.0, got -0.1"),
    (["--training.max_grad_norm", "nan"], "error: training.max_grad_norm: expected a finite float, got 'nan'"),
    (["--training.epochs", "2", "--training.steps", "5"], "error: training.steps: expected unset with training.epochs = 2 "
                                                          "(the epochs decide the steps), got 5; set one of them"),
    (["--training.epochs", "-1"], "error: training.epochs: expected a value >= 0.0, got -1.0"),
    (["--model.lora_dropout", "0.1", "--model.tile_chunk", "64"], "error: model.lora_dropout: expected 0 with "
                                                                  "model.tile_chunk = 64"),
    (["--model.lora_dropout", "1.5"], "error: model.lora_dropout: expected a value >= 0.0 and <= 0.99, got 1.5"),
])
def test_a_bad_training_key_is_one_error_line_and_nothing_written(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    code, _, err = _run([*TINY, *argv, "--output.dir", str(out)], capsys)
    assert code == 2 and err.strip().startswith(message), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_epochs_decide_the_steps_and_every_record_has_hfs_names(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(30)))
    out = tmp_path / "run"
    code, stdout, err = _run([*TINY, "--data.path", str(data), "--training.epochs", "2", "--training.grad_accum", "2",
                              "--training.warmup", "1", "--output.dir", str(out)], capsys)
    assert code == 0, err
    rows = math.ceil(30 * 31 / 128)  # 30 documents of 30-31 tokens (a separator each) pack into 8 rows of 128
    records = _records(out)
    steps = math.ceil(2 * rows / 2)
    assert len(records) == steps and f"training.epochs = 2: {rows} rows per pass, 2 per step: {steps} steps" in stdout
    assert [r["epoch"] for r in records] == pytest.approx([2 * (s + 1) / rows for s in range(steps)])
    assert records[0]["learning_rate"] == 0.0 and all("lr" not in r for r in records)  # HF's warm-up starts at 0
    assert json.loads((out / "run.json").read_text())["training"]["steps"] == steps


def test_lora_dropout_reaches_the_adapters(tmp_path):
    from fm_parallel.trainer.model import build_model

    cfg = load_config([*TINY, "--model.lora_dropout", "0.25"], environ={})
    model = build_model(cfg, 258, torch.device("cpu"))
    drops = [m.lora_dropout["default"].p for m in model.modules() if hasattr(m, "lora_dropout")]
    assert drops and all(p == 0.25 for p in drops)


def test_dpo_logs_trls_reward_metrics_every_step(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = _run([*TINY, "--data.objective", "dpo", "--training.steps", "2", "--output.dir", str(out)], capsys)
    assert code == 0, err
    for r in _records(out):
        for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected"):
            assert math.isfinite(r[k]), (k, r)
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"])
        assert r["logps/chosen"] < 0 and 0 <= r["rewards/accuracies"] <= 1


def test_eval_examples_hold_out_records_that_training_never_reads(tmp_path, capsys):
    from fm_parallel.trainer.data import ByteTokenizer
    from fm_parallel.trainer.metrics import HeldOut
    from fm_parallel.trainer.objectives import SFT

    texts = [f"record {i}: " + "x" * (10 + i) for i in range(12)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = load_config([*TINY, "--data.path", str(data), "--eval.examples", "3"], environ={})
    tok, objective = ByteTokenizer(), SFT(cfg)
    held = HeldOut(cfg, objective, tok)

    def documents(rows):
        return [bytes(r.input_ids[r.sample == d][1:].tolist()).decode() for r in rows for d in range(int(r.sample.max()) + 1)]

    assert documents(held.rows) == texts[:3] and held.examples == 3
    one_pass = list(held.train_stream(objective.rows(tok, passes=1, window=held.train_window)))
    assert documents(one_pass) == texts[3:]  # the rest, from record 4, never the held-out three
    out = tmp_path / "run"
    code, stdout, err = _run([*TINY, "--data.path", str(data), "--eval.examples", "3", "--eval.every", "1",
                              "--training.steps", "2", "--output.dir", str(out)], capsys)
    assert code == 0, err
    evals = [r for r in _records(out) if "eval_loss" in r]
    assert [r["eval_examples"] for r in evals] == [3, 3] and "(3 examples)" in stdout


@pytest.mark.parametrize("argv, message", [
    (["--eval.examples", "12"], "error: eval.examples: expected fewer than the 12 examples of data.path 'DATA' (the rest "
                                "are trained on), got 12"),
    (["--eval.examples", "13", "--eval.path", "DATA"], "error: eval.examples: expected at most the 12 examples of eval.path "
                                                       "'DATA', got 13"),
    (["--eval.examples", "2", "--eval.rows", "1"], "error: eval.examples: expected 0 with eval.rows = 1 (held-out rows or "
                                                   "examples, not both), got 2"),
])
def test_bad_eval_examples_are_one_error_line(tmp_path, capsys, argv, message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(12)))
    argv = [str(data) if a == "DATA" else a for a in argv]
    out = tmp_path / "run"
    code, _, err = _run([*TINY, "--data.path", str(data), *argv, "--output.dir", str(out)], capsys)
    assert code == 2 and err.strip() == message.replace("DATA", str(data)), err
    assert not out.exists()


def test_tokens_per_s_counts_the_trained_tokens_not_the_padding(tmp_path, capsys):
    """A data file smaller than a row: each step's row is mostly padding; throughput counts its documents."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "x" * 29}) + "\n")  # 30 tokens with the separator, in a 128-token row
    out = tmp_path / "run"
    code, _, err = _run([*TINY, "--data.path", str(data), "--training.steps", "2", "--output.dir", str(out)], capsys)
    assert code == 0, err
    for r in _records(out):
        assert r["padding_tokens"] == 128 - 30
        assert r["tokens_per_s"] * r["step_s"] == pytest.approx(30)
