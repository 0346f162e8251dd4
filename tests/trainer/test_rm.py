"""Reward models in the trainer (``data.objective = "rm"``, issue 52 item 3), through the trainer
command (``fm_parallel.trainer.loop.main``, what launch/train.py runs):

- the trainer's loss on a packed row equals ``FlashMaskRewardTrainer``'s (the HF front door, itself
  equal to TRL's ``RewardTrainer``: tests/integrations/test_reward.py) on the same samples;
- pair and K-wise records train, the held-out metrics are logged, and the export loads as
  ``AutoModelForSequenceClassification`` + ``PeftModel`` giving the trained rewards on prompt + response alone;
- a record with one response, equal scores only, an empty response or of neither form is refused
  naming ``file:line`` before anything is written.
(CP ranks against one process: tests/trainer/test_trainer.py's layouts include ``rm``.)"""

import json

import pytest
import torch

from tests.trainer.test_model import _run

pytest.importorskip("transformers")
pytest.importorskip("peft")

ARGS = ["--model.hidden_size", "64", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
        "--model.intermediate_size", "128", "--model.lora_rank", "4", "--training.warmup", "0", "--training.loss_chunk", "128",
        "--parallel.cp", "none", "--output.checkpoint_every", "0", "--data.objective", "rm", "--data.seq_len", "128"]
RECORDS = [{"prompt": "def add(a, b):", "chosen": " return a + b", "rejected": " pass"},
           {"prompt": "import os", "responses": ["\nos.getcwd()", "\nos.exit", "\nprint()"], "scores": [2, 0, 1]},
           {"prompt": "x = [1, 2]", "chosen": "\nx.append(3)", "rejected": "\nx.push(3)"},
           {"prompt": "for i in range(3):", "responses": [" print(i)", " i++", " pass", " continue"], "scores": [3, 0, 1, 1]}]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_trainers_loss_equals_the_hf_reward_trainers_on_the_same_row(tmp_path):
    from transformers import TrainingArguments

    from fm_parallel.distributed.layout import CPLayout
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.data import ByteTokenizer, rm_rows
    from fm_parallel.trainer.model import build_model
    from fm_parallel.trainer.objectives import RM
    from fm_parallel.trainer.parallel import prepare_batch

    data = _write(tmp_path / "rm.jsonl", RECORDS)
    cfg = load_config([*ARGS, "--data.path", str(data), "--model.dtype", "float64", "--model.tile_chunk", "0"], environ={})
    row = next(rm_rows(128, ByteTokenizer(), str(data)))
    assert int(row.sample.max()) + 1 >= 2 and row.scores.shape[1] >= 3 and row.scores.isnan().any()  # mixed K in one row
    model = build_model(cfg, 258, torch.device("cpu"), head="score")
    with torch.no_grad():
        model.get_base_model().score.modules_to_save["default"].weight.normal_()  # rewards that differ
    want = RM(cfg).loss(model, prepare_batch(row, CPLayout("none"), cfg, torch.device("cpu")), CPLayout("none"))
    want = want / RM(cfg).denominator([row])

    # The same samples as the HF trainer's examples: the row's own tokens (separators included) per part.
    ids, seg, smp = row.input_ids.tolist(), row.segment.tolist(), row.sample.tolist()
    examples = []
    for i in range(int(row.sample.max()) + 1):
        part = lambda g: [t for t, s_, k in zip(ids, smp, seg) if s_ == i and k == g]  # noqa: E731
        k = int(torch.isfinite(row.scores[i]).sum())
        examples.append({"prompt_ids": part(0), "response_ids": [part(r + 1) for r in range(k)],
                         "scores": row.scores[i, :k].tolist()})
    by_k = {}
    for e in examples:  # the HF collator takes one K per batch: one batch per K, losses weighted by their pairs
        by_k.setdefault(len(e["response_ids"]), []).append(e)
    from fm_parallel.integrations.collator import FlashMaskCollator
    from fm_parallel.preference import ranked_pairs

    hf = FlashMaskRewardTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[]))
    total, pairs = 0.0, 0
    for group in by_k.values():
        batch = FlashMaskCollator(preference=True)(group)
        n = len(ranked_pairs(batch["fm_scores"])[0])
        with torch.no_grad():
            total += hf.compute_loss(model, batch).item() * n
        pairs += n
    assert pairs == RM(cfg).denominator([row])
    assert want.item() == pytest.approx(total / pairs, rel=1e-10)


def test_pair_and_k_wise_records_train_and_the_export_loads_as_a_sequence_classifier(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from fm_parallel.trainer.data import ByteTokenizer

    data = _write(tmp_path / "rm.jsonl", RECORDS * 4)
    out = tmp_path / "run"
    code, _, err = _run([*ARGS, "--data.path", str(data), "--training.steps", "4", "--training.lr", "3e-3",
                         "--eval.rows", "1", "--eval.path", str(data), "--eval.every", "2", "--output.dir", str(out)], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and set(evals[-1]) >= {"eval_loss", "eval_accuracy", "eval_margin", "eval_reward_chosen", "eval_reward_rejected"}
    info = json.loads((out / "adapter" / "fm_parallel.json").read_text())
    assert info["load"].startswith("PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=1)")
    base = AutoModelForSequenceClassification.from_pretrained(str(out / "base_model"), num_labels=1)
    model = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    tok = ByteTokenizer()
    # The exported model scores prompt + SEP + response as the trainer read it: the trained head, not a
    # fresh one (a missing score head would load as random and the two rewards would be unrelated).
    head = model.get_base_model().score  # peft's wrapper: the trained copy beside the base folder's initial head
    assert not torch.equal(head.modules_to_save["default"].weight, head.original_module.weight)
    ids = torch.tensor([tok.encode(RECORDS[0]["prompt"]) + [tok.bos_id] + tok.encode(RECORDS[0]["chosen"])])
    with torch.no_grad():
        reward = model(input_ids=ids).logits
    assert reward.shape == (1, 1) and torch.isfinite(reward).all()


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "responses": ["a"], "scores": [1]}, "expected at least two responses with different scores"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1, 1]}, "expected at least two responses with different scores"),
    ({"prompt": "p", "chosen": "a", "rejected": ""}, "expected non-empty responses, got an empty response at index 1"),
    ({"prompt": "p", "responses": ["a", "b"], "scores": [1]}, "expected one score per response, got 1 scores for 2 responses"),
    ({"prompt": "p", "chosen": "a"}, 'expected a preference record of one of the formats {"prompt", "chosen", "rejected"}'),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "responses": ["a", "b"], "scores": [1, 0]}, "expected either chosen / rejected or responses / scores, got both forms"),
])
def test_a_bad_record_is_refused_naming_file_and_line(tmp_path, capsys, record, message):
    data = _write(tmp_path / "rm.jsonl", [RECORDS[0], record])
    out = tmp_path / "run"
    code, _, err = _run([*ARGS, "--data.path", str(data), "--output.dir", str(out)], capsys)
    assert code == 2, err
    assert f"error: {data}:2: {message}" in err, err
    assert not out.exists()
