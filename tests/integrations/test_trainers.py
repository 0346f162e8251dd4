"""Through the engines users run: HF ``Trainer`` with the flattening collator and TRL ``SFTTrainer``
padding-free, LoRA, our backend; per-step losses equal to ``sdpa`` on the same documents unpacked."""

import tempfile
import warnings

import pytest
import torch

from tests.integrations.test_transformers import tiny_llama

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


def hf_trainer_losses(attention: str, collator) -> list[float]:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(tiny_llama(attention).float(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=4, learning_rate=1e-3,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
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


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def trl_losses(attention: str, padding_free: bool) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-3,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, padding_free=padding_free,
                     max_length=None, bf16=False, disable_tqdm=True)
    trainer = SFTTrainer(model=tiny_llama(attention).float(), args=args, processing_class=tiny_tokenizer(),
                         train_dataset=Dataset.from_list([{"input_ids": d} for d in documents()]),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trl_sft_trainer_padding_free_equals_sdpa_unpacked():
    pytest.importorskip("trl")
    from fm_parallel.integrations import transformers as fm_hf

    got, want = trl_losses(fm_hf.register(), padding_free=True), trl_losses("sdpa", padding_free=False)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
