"""Shared-prompt DPO in the HF Trainer (``FlashMaskDPOTrainer``): per-step losses and TRL's DPO metrics
equal TRL's ``DPOTrainer`` on the same pairs (its layout: prompt + response rows, sdpa), the reference
through ``ref_model`` equals DPO computed by hand on each sequence alone, and a plain ``Trainer`` given
preference rows raises instead of training next-token loss."""

import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")

SEP, EOS = 3, 1  # every response starts with SEP (its first token is not scored: see the collator) and ends with EOS
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


def pairs(count=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(4, 128, (n,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(6 + i), "chosen_ids": [SEP] + ids(3 + i) + [EOS], "rejected_ids": [SEP] + ids(5) + [EOS]}
            for i in range(count)]


def lora(model, seed=1):
    from peft import LoraConfig, get_peft_model

    # The default init (B = 0): the adapter disabled (our reference) is then also the initial adapter
    # (TRL's reference when handed a peft model).
    torch.manual_seed(seed)
    return get_peft_model(model.float(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def word_tokenizer():
    """Token i is the word ``w{i}``; the special tokens' names are no prefix of a word (an added token
    "t1" would split "t117")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def common_args(**extra):
    return dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, **extra)


def logged(trainer):
    return [{k: h[k] for k in ("loss",) + METRICS} for h in trainer.state.log_history if "loss" in h]


def test_dpo_trainer_equals_trl_dpo_trainer_step_by_step():
    """Three LoRA steps on four pairs (one batch): losses and the six DPO metrics equal TRL's."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    data = pairs()
    ours = FlashMaskDPOTrainer(model=lora(tiny_llama(fm_hf.register())), args=TrainingArguments(**common_args()), beta=0.1,
                               train_dataset=Dataset.from_list(data))  # remove_unused_columns left True
    ours.train()

    # TRL's layout: prompt + SEP, then the response after it (what our rows score: the tokens after SEP).
    text = lambda ids: " ".join("<eos>" if t == EOS else f"w{t}" for t in ids)  # noqa: E731
    trl_data = Dataset.from_list([{"prompt": text(d["prompt_ids"] + [SEP]), "chosen": " " + text(d["chosen_ids"][1:]),
                                   "rejected": " " + text(d["rejected_ids"][1:])} for d in data])
    ref = trl.DPOTrainer(model=lora(tiny_llama("sdpa")), args=trl.DPOConfig(**common_args(), beta=0.1, bf16=False),
                         train_dataset=trl_data, processing_class=word_tokenizer())
    ref.train()

    got, want = logged(ours), logged(ref)
    assert len(got) == 3 and len(want) == 3
    for g, w in zip(got, want):
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (key, got, want)
    assert got[0]["loss"] == pytest.approx(0.693147, abs=1e-6) and got[-1]["loss"] < got[0]["loss"] - 1e-3  # it learns


def test_ref_model_evaluation_equals_dpo_by_hand_on_each_sequence_alone():
    """A full model with ``ref_model=`` (no peft), packed two pairs per row: ``evaluate()``'s loss and
    metrics equal DPO computed from sdpa on each prompt + response alone."""
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.collator import FlashMaskCollator
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    data, beta = pairs(4, seed=3), 0.5
    name = fm_hf.register()
    policy, reference = tiny_llama(name, seed=0).float(), tiny_llama(name, seed=5).float()
    args = TrainingArguments(**common_args(per_device_eval_batch_size=4))
    trainer = FlashMaskDPOTrainer(model=policy, ref_model=reference, args=args, beta=beta, eval_dataset=data,
                                  data_collator=FlashMaskCollator(seq_len=48))
    got = trainer.evaluate()

    def logps(model, d):
        out = []
        for key in ("chosen_ids", "rejected_ids"):
            ids = torch.tensor([d["prompt_ids"] + d[key]])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp[len(d["prompt_ids"]):].sum())  # the response's tokens after SEP
        return torch.stack(out)

    sp, sr = tiny_llama("sdpa", seed=0), tiny_llama("sdpa", seed=5)
    pi = torch.stack([logps(sp, d) for d in data])
    ref = torch.stack([logps(sr, d) for d in data])
    chosen, rejected = beta * (pi[:, 0] - ref[:, 0]), beta * (pi[:, 1] - ref[:, 1])
    want = {"eval_loss": -F.logsigmoid(chosen - rejected).mean(), "eval_rewards/chosen": chosen.mean(),
            "eval_rewards/rejected": rejected.mean(), "eval_rewards/margins": (chosen - rejected).mean(),
            "eval_rewards/accuracies": (chosen > rejected).double().mean(),
            "eval_logps/chosen": pi[:, 0].mean(), "eval_logps/rejected": pi[:, 1].mean()}
    for key, value in want.items():
        assert got[key] == pytest.approx(float(value), rel=1e-5, abs=1e-6), (key, got[key], float(value))
    assert 0 < float(want["eval_rewards/accuracies"]) < 1 or abs(float(want["eval_rewards/margins"])) > 1e-3


def test_plain_trainer_or_forward_on_preference_rows_raises_naming_the_fix():
    """Before: the Trainer trained next-token loss on both responses without a word (issue 31.4); on an
    ``sdpa`` model it still did, the backend's guard never running: the collator refuses pairs unless asked."""
    from transformers import Trainer, TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.collator import FlashMaskCollator

    model = lora(tiny_llama(fm_hf.register()))
    for attention in ("sdpa", fm_hf.register()):  # sdpa ignores the mask: only the collator can say it
        trainer = Trainer(model=lora(tiny_llama(attention)), args=TrainingArguments(**common_args(remove_unused_columns=False)),
                          train_dataset=pairs(), data_collator=FlashMaskCollator())
        with pytest.raises(ValueError, match=r"examples\[0\]: .*preference row.*FlashMaskDPOTrainer"):
            trainer.train()
    trainer = Trainer(model=model, args=TrainingArguments(**common_args(remove_unused_columns=False)),
                      train_dataset=pairs(), data_collator=FlashMaskCollator(preference=True))
    with pytest.raises(ValueError, match="fm_segment: expected no preference-row layout.*FlashMaskDPOTrainer"):
        trainer.train()
    batch = FlashMaskCollator(preference=True)(pairs(2))
    with pytest.raises(ValueError, match="FlashMaskDPOTrainer"):
        model(**batch)
    model(**{k: batch[k] for k in ("input_ids", "position_ids", "flashmask")})  # the model's inputs alone are fine


def test_dpo_trainer_refuses_what_would_train_wrongly():
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    args = TrainingArguments(**common_args())
    with pytest.raises(ValueError, match="model: expected a model loaded with attn_implementation=.*got attn_implementation 'sdpa'"):
        FlashMaskDPOTrainer(model=lora(tiny_llama("sdpa")), args=args, train_dataset=pairs())  # flashmask= ignored there
    with pytest.raises(ValueError, match="ref_model: expected a reference model, or a peft model"):
        FlashMaskDPOTrainer(model=tiny_llama(fm_hf.register()).float(), args=args, train_dataset=pairs())
    with pytest.raises(ValueError, match="beta: expected a finite float > 0, got 0"):
        FlashMaskDPOTrainer(model=lora(tiny_llama(fm_hf.register())), args=args, beta=0, train_dataset=pairs())
    four = [{"prompt_ids": [5, 6], "response_ids": [[SEP, 7], [SEP, 8], [SEP, 9], [SEP, 10]]}] * 4
    trainer = FlashMaskDPOTrainer(model=lora(tiny_llama(fm_hf.register())), args=args, train_dataset=four)
    with pytest.raises(ValueError, match=r"responses: expected 4 \(the batch's layout"):
        trainer.train()



def test_dpo_trainer_equals_the_fm_parallel_trainers_dpo_objective(tmp_path):
    """The same pairs through the project's trainer objective (fm_parallel.trainer.objectives.DPO, its
    packed row from a JSONL file, byte tokens) and through FlashMaskDPOTrainer: the same mean loss."""
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from fm_parallel.distributed.layout import CPLayout
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.data import ByteTokenizer, dpo_rows
    from fm_parallel.trainer.objectives import DPO
    from fm_parallel.trainer.parallel import prepare_batch

    data = tmp_path / "pairs.jsonl"
    records = [{"prompt": "def f(x):", "chosen": " return x", "rejected": " pass"},
               {"prompt": "import os", "chosen": "\nos.getcwd()", "rejected": "\nos.exit"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config([], environ={"FM_DATA__OBJECTIVE": "dpo", "FM_DATA__PATH": str(data), "FM_DATA__SEQ_LEN": "96",
                                   "FM_TRAINING__DPO_BETA": "0.5"})
    row = next(dpo_rows(96, ByteTokenizer(), str(data)))
    assert int(row.sample.max()) == 1  # both pairs in one row

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation=fm_hf.register()))
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    lay = CPLayout("none")
    with torch.no_grad():
        want = DPO(cfg).loss(model, prepare_batch(row, lay, cfg, torch.device("cpu")), lay) / (int(row.sample.max()) + 1)

    ids, seg, smp = row.input_ids.tolist(), row.segment.tolist(), row.sample.tolist()
    pairs_ = [{key: [t for t, g, s in zip(ids, seg, smp) if s == i and g == part]
               for part, key in enumerate(("prompt_ids", "chosen_ids", "rejected_ids"))} for i in range(2)]
    trainer = FlashMaskDPOTrainer(model=model, beta=0.5, eval_dataset=pairs_,
                                  args=TrainingArguments(**common_args(per_device_eval_batch_size=2)))
    got = trainer.evaluate()["eval_loss"]
    assert abs(float(want) - 0.6931) > 1e-3  # a random adapter: the policy is not the reference
    assert got == pytest.approx(float(want), rel=1e-6), (got, float(want))
