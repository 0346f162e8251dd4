"""Through the engines users run: HF ``Trainer`` with the flattening collator and TRL ``SFTTrainer``
padding-free, LoRA, our backend; per-step losses equal to ``sdpa`` on the same documents unpacked."""

import tempfile
import warnings

import pytest
import torch

from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")


def documents(count=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (count,), generator=g)]


def pad_collate(examples):
    """The unpacked reference: one document per row, right padding, the same targets."""
    n = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), n, dtype=torch.long)
    att, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        m = len(e["input_ids"])
        ids[i, :m] = torch.tensor(e["input_ids"])
        att[i, :m] = 1
        labels[i, 1:m] = ids[i, 1:m]  # as the flattening collator: a document's first token is no target
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


def hf_trainer_losses(attention: str, collator, **extra) -> list[float]:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(tiny_llama(attention).float(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=4, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             **extra)
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": d} for d in documents()], data_collator=collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_hf_trainer_with_the_flattening_collator_equals_sdpa_unpacked():
    from transformers import DataCollatorWithFlattening

    from fm_parallel.integrations import transformers as fm_hf

    want = hf_trainer_losses("sdpa", pad_collate)
    for flash_kwargs in (True, False):
        got = hf_trainer_losses(fm_hf.register(), DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs))
        assert len(got) == 4 and got == pytest.approx(want, rel=1e-5, abs=1e-6), (flash_kwargs, got, want)


def test_hf_trainer_bf16_mixed_precision_trains_like_sdpa():
    """``bf16=True`` with fp32 weights: q, k, v reach attention in mixed dtypes under autocast; the backend
    computes in bf16 as sdpa does (this crashed with a dtype error before)."""
    from transformers import DataCollatorWithFlattening

    from fm_parallel.integrations import transformers as fm_hf

    got = hf_trainer_losses(fm_hf.register(), DataCollatorWithFlattening(), bf16=True)
    want = hf_trainer_losses("sdpa", pad_collate, bf16=True)
    assert len(got) == 4 and got == pytest.approx(want, abs=2e-3), (got, want)  # bf16 rounding, not a mask difference


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def trl_losses(attention: str, padding_free: bool, bf16: bool = False, prepare=None) -> list[float]:
    """Per-step losses of TRL's ``SFTTrainer`` (LoRA from ``peft_config``) on a float32 tiny Llama;
    ``prepare(model)``: called on the model before TRL wraps it."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    model = tiny_llama(attention).float()
    if prepare is not None:
        prepare(model)
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, padding_free=padding_free,
                     max_length=None, bf16=bf16, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, processing_class=tiny_tokenizer(),
                         train_dataset=Dataset.from_list([{"input_ids": d} for d in documents()]),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_trl_sft_trainer_padding_free_equals_sdpa_unpacked(bf16):
    pytest.importorskip("trl")
    from fm_parallel.integrations import transformers as fm_hf

    got, want = trl_losses(fm_hf.register(), True, bf16), trl_losses("sdpa", False, bf16)
    tolerance = dict(abs=2e-3) if bf16 else dict(rel=1e-5, abs=1e-6)  # bf16 rounding differs by kernel
    assert len(got) == 3 and got == pytest.approx(want, **tolerance), (got, want)
