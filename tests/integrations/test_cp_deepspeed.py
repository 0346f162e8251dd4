"""``context_parallel(Trainer)`` under DeepSpeed ZeRO (issue 52 item 4): the Trainer's DeepSpeed engine
partitions parameters, gradients and optimizer state over every rank while our CP groups shard each
row; on 2 gloo ranks the per-step losses equal one process's plain ``Trainer`` (1e-5) for ZeRO-3 with
LoRA and with every weight trained, and ZeRO-2 under Ulysses. (It used to be refused.)"""

import os
import tempfile
import warnings

import pytest
import torch

from tests.distributed.spawn import run_cases

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytest.importorskip("peft")
warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fm_parallel/torch_extensions"))

TOL = 1e-5


def train(cp_degree: int | None, mode: str = "ring", stage: int | None = None, lora: bool = True) -> list[float]:
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel
    from tests.integrations.test_context_parallel import _documents, _model

    if lora:
        model = _model()
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                             attn_implementation=fm_hf.register()))
    extra = {}
    if stage is not None:
        extra["deepspeed"] = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}}
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=3, max_steps=3, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, save_strategy="no", **extra)
    common = dict(model=model, args=args, train_dataset=_documents(), data_collator=DataCollatorWithFlattening())
    if cp_degree is None:
        trainer = Trainer(**common)
    else:
        trainer = context_parallel(Trainer)(**common, cp=ContextParallelConfig(degree=cp_degree, mode=mode))
        assert trainer.is_deepspeed_enabled == (stage is not None)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _case(rank, world, mode, stage, lora):
    import deepspeed

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29564")
    deepspeed.init_distributed(dist_backend="gloo")  # use_cpu=True: accelerate leaves deepspeed.comm to us
    return {"losses": train(world, mode, stage, lora)}


CASES = [("ring", 3, True), ("ring", 3, False), ("ulysses", 2, True)]


@pytest.fixture(scope="module")
def two():
    # One DeepSpeed trainer per process (DeepSpeed's comm and its engine state are process-wide).
    out = {}
    for mode, stage, lora in CASES:
        out.update(run_cases(2, {f"{mode}-{stage}-{lora}": (_case, (mode, stage, lora))}, timeout=400))
    return out


@pytest.mark.parametrize("mode, stage, lora", CASES, ids=[f"{m}-zero{s}-{'lora' if l_ else 'full'}" for m, s, l_ in CASES])
def test_zero_under_cp_equals_one_process(two, mode, stage, lora):
    os.environ.pop("WORLD_SIZE", None)
    want = train(None, lora=lora)
    for res in two[f"{mode}-{stage}-{lora}"]:
        assert "exception" not in res, res.get("traceback")
        assert len(res["losses"]) == 3 and res["losses"] == pytest.approx(want, rel=TOL, abs=TOL), (res["losses"], want)
    assert want[-1] != want[0]
