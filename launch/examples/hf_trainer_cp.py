"""Context parallelism in the Hugging Face ``Trainer``: packed documents (or shared-prompt DPO pairs)
with FlashMask attention over ring, Ulysses or hybrid CP, LoRA through peft.

A tiny random Llama (or ``--model`` a folder) trains ``--steps`` steps; packed rows come from
``DataCollatorWithFlattening`` (``--dpo``: ``FlashMaskDPOTrainer`` on ``FlashMaskCollator``'s
shared-prompt rows). One line per step, ``step N loss X``; torchrun's ranks print the one-process
losses. From the repository root::

    python launch/examples/hf_trainer_cp.py --cp-degree 1 --steps 3                               # one process
    torchrun --standalone --nproc_per_node 2 launch/examples/hf_trainer_cp.py --cp-degree 2 --steps 3
    torchrun --standalone --nproc_per_node 2 launch/examples/hf_trainer_cp.py --cp-degree 2 --steps 3 --cp-mode ulysses
    torchrun --standalone --nproc_per_node 2 launch/examples/hf_trainer_cp.py --cp-degree 2 --steps 3 --dpo
    torchrun --standalone --nproc_per_node 2 launch/examples/hf_trainer_cp.py --cp-degree 2 --steps 3 --zero 3

``--nproc_per_node`` a multiple of ``--cp-degree``: the rest is data parallelism across CP groups.
On CPUs the ranks talk over gloo; with GPUs (one per rank) over NCCL. ``--zero 1|2|3``: the
Trainer's DeepSpeed engine (ZeRO stage 1-3; the ``deepspeed`` extra) partitions the trained weights,
gradients and optimizer state over every rank while the CP groups shard each row (under torchrun).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch

# Ranks compete for few cores otherwise (the user's own setting wins).
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

VOCAB = 128


def tiny_llama(path: str | None):
    """``path``'s model, or a tiny random Llama (seeded: the same on every rank), on our attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    if path:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation=fm_hf.register())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, attn_implementation=fm_hf.register())
    return LlamaForCausalLM(cfg)


def documents(count: int = 24, seed: int = 0, vocab: int = VOCAB) -> list[dict]:
    """Documents of 5-39 random tokens (packed three per row by the collator)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
            for n in torch.randint(5, 40, (count,), generator=g)]


def pairs(count: int = 16, seed: int = 0, vocab: int = VOCAB) -> list[dict]:
    """DPO pairs: a prompt and two responses, each response starting with the separator 3."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(4, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(6, 20), "chosen_ids": [3] + ids(3, 12), "rejected_ids": [3] + ids(3, 12)} for _ in range(count)]


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


class PrintLoss:
    """Prints ``step N loss X`` (6 decimals) on the first rank at every log (``logging_steps=1``)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Print(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if state.is_world_process_zero and logs and "loss" in logs:
                    print(f"step {state.global_step} loss {logs['loss']:.6f}", flush=True)

        return _Print()


def parse(argv=None, description: str = __doc__):
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or hub id (default: a tiny random Llama)")
    parser.add_argument("--cp-degree", type=int, default=1, help="ranks per context-parallel group")
    parser.add_argument("--cp-mode", choices=["ring", "ulysses", "hybrid"], default="ring")
    parser.add_argument("--balance", choices=["contiguous", "zigzag", "mask"], default="contiguous")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dpo", action="store_true", help="shared-prompt DPO pairs (FlashMaskDPOTrainer)")
    parser.add_argument("--zero", type=int, choices=[1, 2, 3], default=None,
                        help="DeepSpeed ZeRO stage for the Trainer's engine (under torchrun)")
    args = parser.parse_args(argv)
    if args.zero is not None and "LOCAL_RANK" not in os.environ:
        parser.error("--zero: expected a launch by torchrun (DeepSpeed's engine joins its process group), got one process")
    return args


def deepspeed_config(stage: int | None, batch: int) -> dict:
    """``TrainingArguments(deepspeed=...)`` for ZeRO ``stage`` (None: {}, no DeepSpeed). On CPUs the
    process group is DeepSpeed's over gloo, made here (accelerate makes it only on GPUs)."""
    if stage is None:
        return {}
    import deepspeed

    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fm_parallel/torch_extensions"))
        deepspeed.init_distributed(dist_backend="gloo")
    return {"deepspeed": {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
                          "zero_optimization": {"stage": stage}, "bf16": {"enabled": False}}}


def training_args(cls, steps: int, batch: int, **extra):
    return cls(output_dir=os.path.join(tempfile.gettempdir(), "fm_parallel_hf_trainer_cp"), per_device_train_batch_size=batch,
               max_steps=steps, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
               use_cpu=not torch.cuda.is_available(), seed=0,
               # every LoRA weight takes part in each step: DDP need not search for unused ones (it warned per rank)
               ddp_find_unused_parameters=False, **extra)


def dpo_trainer(args, cp):
    """``FlashMaskDPOTrainer`` (reference: the adapter disabled) with ``cp=``, on shared-prompt pairs."""
    from transformers import TrainingArguments

    from fm_parallel.integrations.context_parallel import context_parallel
    from fm_parallel.integrations.dpo import FlashMaskDPOTrainer

    model = lora(tiny_llama(args.model))
    vocab = model.get_base_model().config.vocab_size
    return context_parallel(FlashMaskDPOTrainer)(model=model, beta=0.1, train_dataset=pairs(vocab=vocab), cp=cp,
                                                 args=training_args(TrainingArguments, args.steps, 2,
                                                                    **deepspeed_config(args.zero, 2)),
                                                 callbacks=[PrintLoss()])


def main(argv=None) -> list[float]:
    args = parse(argv)
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    cp = ContextParallelConfig(degree=args.cp_degree, mode=args.cp_mode, balance=args.balance)
    if args.dpo:
        trainer = dpo_trainer(args, cp)
    else:
        model = lora(tiny_llama(args.model))
        vocab = model.get_base_model().config.vocab_size
        trainer = context_parallel(Trainer)(model=model, args=training_args(TrainingArguments, args.steps, 3,
                                                                             **deepspeed_config(args.zero, 3)),
                                            train_dataset=documents(vocab=vocab), data_collator=DataCollatorWithFlattening(),
                                            cp=cp, callbacks=[PrintLoss()])
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    try:
        main()
    finally:
        # accelerate made the process group: end it before the interpreter does, as torch asks. (The abort
        # once seen at exit, "terminate called without an active exception", was gloo's worker freeing a
        # finished work's tensors during shutdown: fm_parallel.distributed.comm.hold_works.)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
