"""The HF preference trainers take TRL's text datasets: ``FlashMaskDPOTrainer(processing_class=tok)``
on text records (strings and conversations, explicit and implicit prompts) logs the losses and DPO
metrics of TRL's ``DPOTrainer`` on the same records, step by step; ``FlashMaskRewardTrainer``'s
examples are ``RewardTrainer``'s tokens; a bad record, or text without a tokenizer, is refused by name."""

import tempfile
import warnings

import pytest
import torch

from tests.trainer.test_formats import CHAT, PREFERENCE, make_tokenizer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tokenizer(tmp_path_factory.mktemp("tok")))


def llama(vocab: int, impl: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)).double()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def args(**extra):
    return dict(dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True), **extra)


def logged(trainer):
    return [{k: h[k] for k in ("loss",) + METRICS} for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("form, container", [(form, "list") for form in PREFERENCE] + [("chat_explicit", "Dataset")])
def test_dpo_on_text_records_logs_trls_losses_and_metrics(tok, form, container):
    """Three LoRA steps on each form's records (one batch): losses and TRL's six DPO metrics equal
    ``DPOTrainer``'s on the same records and tokenizer (sdpa, its own layout)."""
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    records = PREFERENCE[form]
    data = [dict(r) for r in records] if container == "list" else datasets.Dataset.from_list(records)
    ours = FlashMaskDPOTrainer(model=llama(len(tok), fm_hf.register()), args=TrainingArguments(**args()), beta=0.1,
                               train_dataset=data, processing_class=tok)
    ours.train()
    ref = trl.DPOTrainer(model=llama(len(tok), "sdpa"), args=trl.DPOConfig(**args(), beta=0.1, bf16=False),
                         train_dataset=datasets.Dataset.from_list(records), processing_class=tok)
    ref.train()
    got, want = logged(ours), logged(ref)
    assert len(got) == 3 and len(want) == 3
    for g, w in zip(got, want):
        for key in w:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (key, got, want)  # TRL logs float32
    assert got[-1]["loss"] < got[0]["loss"] - 1e-4  # it learns


def test_reward_examples_are_trls_reward_trainer_tokens(tok):
    from fm_parallel.integrations.text_examples import reward_examples

    got = reward_examples(datasets.Dataset.from_list(PREFERENCE["chat_explicit"]), tok)
    ref = trl.RewardTrainer(model=_classifier(len(tok), tok.pad_token_id), args=trl.RewardConfig(**args()),
                            train_dataset=datasets.Dataset.from_list(PREFERENCE["chat_explicit"]), processing_class=tok)
    for ours, theirs in zip(got, ref.train_dataset):
        assert [ours["prompt_ids"] + r for r in ours["response_ids"]] == [theirs["chosen_ids"], theirs["rejected_ids"]]
        assert ours["scores"] == [1.0, 0.0]


def _classifier(vocab, pad):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    path = tempfile.mkdtemp()
    LlamaForSequenceClassification(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                               pad_token_id=pad)).save_pretrained(path)
    return path


def test_the_reward_trainer_trains_on_text_records(tok):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.reward import FlashMaskRewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(_classifier(len(tok), tok.pad_token_id), num_labels=1,
                                                               attn_implementation=fm_hf.register())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    records = PREFERENCE["explicit"] + [{"prompt": "import", "responses": [" os", " sys", " x"], "scores": [2, 1, 0]}]
    trainer = FlashMaskRewardTrainer(model=model, args=TrainingArguments(**args(per_device_train_batch_size=1)),
                                     train_dataset=records, processing_class=tok)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("records, processing, message", [
    ([{"prompt": "p", "chosen": "c"}], True, r"train_dataset\[0\]: expected a preference record of one of the formats"),
    ([{"prompt": CHAT[:2], "chosen": "c", "rejected": "r"}], True, r"train_dataset\[0\]: expected the prompt and every "
                                                                    r"response alike"),
    ([{"prompt": "p", "chosen": "c", "rejected": "r"}], False, r"processing_class: expected the tokenizer that tokenizes "
                                                               r"train_dataset's text records"),
])
def test_a_bad_text_record_or_no_tokenizer_is_refused_by_name(tok, records, processing, message):
    from transformers import TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    with pytest.raises(ValueError, match=message):
        FlashMaskDPOTrainer(model=llama(len(tok), fm_hf.register()), args=TrainingArguments(**args()), train_dataset=records,
                            **({"processing_class": tok} if processing else {}))
