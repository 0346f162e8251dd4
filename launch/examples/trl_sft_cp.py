"""Context parallelism in TRL's ``SFTTrainer``: padding-free packed documents with FlashMask attention
over ring, Ulysses or hybrid CP, LoRA through ``peft_config``.

TRL's padding-free collator packs the documents of a batch into one row with restarting
``position_ids`` (the mask's documents); ``--dpo`` trains shared-prompt DPO pairs with
``FlashMaskDPOTrainer`` instead (as ``hf_trainer_cp.py --dpo``). One line per step, ``step N loss X``;
torchrun's ranks print the one-process losses. From the repository root::

    python launch/examples/trl_sft_cp.py --cp-degree 1 --steps 3                               # one process
    torchrun --standalone --nproc_per_node 2 launch/examples/trl_sft_cp.py --cp-degree 2 --steps 3
    torchrun --standalone --nproc_per_node 2 launch/examples/trl_sft_cp.py --cp-degree 2 --steps 3 --cp-mode ulysses

``--nproc_per_node`` a multiple of ``--cp-degree``: the rest is data parallelism across CP groups.
"""

from __future__ import annotations

# The example beside this one (a script's own folder is on sys.path when it runs).
from hf_trainer_cp import PrintLoss, documents, dpo_trainer, parse, tiny_llama, training_args


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer over ``t0 .. t{vocab-1}`` (the examples are token ids already; TRL wants one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def main(argv=None) -> list[float]:
    args = parse(argv, __doc__)
    from fm_parallel.integrations.context_parallel import ContextParallelConfig, context_parallel

    cp = ContextParallelConfig(degree=args.cp_degree, mode=args.cp_mode, balance=args.balance)
    if args.dpo:
        trainer = dpo_trainer(args, cp)
    else:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        model = tiny_llama(args.model)
        vocab = model.config.vocab_size
        tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else tiny_tokenizer(vocab)
        sft = training_args(SFTConfig, args.steps, 3, padding_free=True, max_length=None,
                           bf16=False)  # TRL defaults to bf16 autocast: fp32 here, so the ranks print the one-process digits
        trainer = context_parallel(SFTTrainer)(model=model, args=sft, processing_class=tokenizer,
                                               train_dataset=Dataset.from_list(documents(vocab=vocab)),
                                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
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
