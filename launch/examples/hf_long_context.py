"""Long context in Hugging Face's ``Trainer`` or TRL's ``SFTTrainer``: the long-context components
(:func:`fm_parallel.longcontext.long_context`) on an HF Llama with FlashMask attention and a peft LoRA,
one long causal document (or packed documents) per step.

What the components do here: every decoder layer a tiled layer (its own checkpoint, attention over
query chunks), every layer's checkpointed input in pinned host memory, and the loss over token chunks
(``loss_chunk``: HF ``Trainer``'s loss through the model's forward; TRL's ``SFTTrainer`` uses its own
fused head). One line per step: its time, the document tokens per second (padding is never counted;
these rows have none), the GPU's peak memory and the model FLOP/s. From the repository root::

    python launch/examples/hf_long_context.py                                   # CPU: tiny Llama, 2,048 tokens
    python launch/examples/hf_long_context.py --trainer trl --documents 4       # TRL's SFTTrainer, 4 packed documents
    python launch/examples/hf_long_context.py --shape 8b --length 262144        # one 80 GB GPU: 8B shape, 256k
    python launch/examples/hf_long_context.py --model PATH --length 262144      # your checkpoint (a Llama-like causal LM)
    python launch/examples/hf_long_context.py --shape 8b --length 262144 --device-gib 60 --host-gib 100   # planned

``--shape`` builds a randomly initialised Llama of that shape (``tiny``, ``1b``: Llama 3.2 1B, ``8b``:
Llama 3.1 8B; 128,256-token vocabulary) so that no download is needed; ``--layers`` keeps fewer of its
decoder layers (said in the output). Random token ids: the losses show the step runs, not learning.
``--device-gib`` (a GPU): the memory plan (:func:`fm_parallel.longcontext.plan_long_context`, from one
layer measured at two short lengths) chooses the checkpoints kept, offloaded and recomputed instead of
``--offload-layers``.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "tiny": (64, 2, 4, 2, 128, 512),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("hf", "trl"), default="hf", help="HF Trainer or TRL's SFTTrainer (default hf)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="a Llama shape built with random weights")
    p.add_argument("--model", default="", help="a local model folder instead of --shape")
    p.add_argument("--layers", type=int, default=0, help="keep this many decoder layers (0: all)")
    p.add_argument("--length", type=int, default=2048, help="tokens per step (one row)")
    p.add_argument("--documents", type=int, default=1, help="documents packed in the row (1: one long document)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tile-chunk", type=int, default=0, help="tokens per tile (default: 16384 on a GPU, 256 on the CPU)")
    p.add_argument("--attention-chunk", type=int, default=0, help="query rows per attention call (default 65536, CPU 512)")
    p.add_argument("--loss-chunk", type=int, default=0, help="tokens per loss chunk (default 4096, CPU 256)")
    p.add_argument("--offload-layers", type=int, default=-1, help="layers whose checkpoints live on the host (-1: all)")
    p.add_argument("--device-gib", type=float, default=0.0,
                   help="GPU memory for the step: the memory plan picks the layout (measured on one layer first)")
    p.add_argument("--host-gib", type=float, default=100.0, help="host memory for checkpoints, with --device-gib")
    p.add_argument("--no-compile", action="store_true", help="on a GPU, run the tiled layers' per-token parts eagerly")
    args = p.parse_args(argv)
    for name in ("length", "documents", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.length % args.documents:
        p.error(f"--documents: expected a divisor of --length {args.length}, got {args.documents}")
    if args.layers < 0:
        p.error(f"--layers: expected an int >= 0, got {args.layers}")
    if args.device_gib < 0 or (args.device_gib and args.host_gib <= 0):
        p.error(f"--device-gib / --host-gib: expected GiB > 0, got {args.device_gib} / {args.host_gib}")
    return args


def build_model(args, attention: str, cuda: bool):
    """The causal LM in bfloat16 on the GPU (float32 on the CPU), with FlashMask attention."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if cuda else torch.float32
    if args.model:
        config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    else:
        hidden, layers, heads, kv, inter, vocab = SHAPES[args.shape]
        config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                             max_position_embeddings=max(args.length, 8192), rope_theta=500000.0)
    if args.layers:
        config.num_hidden_layers = min(args.layers, config.num_hidden_layers)
    config.use_cache = False
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, config=config, dtype=dtype, attn_implementation=attention,
                                                    local_files_only=True).to("cuda" if cuda else "cpu")
    config._attn_implementation = attention
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if cuda else "cpu"):  # built where it runs: no 8B copy on the host
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def examples(args, vocab: int) -> list[dict]:
    """``steps`` rows' worth of documents (each step's row: ``documents`` documents of equal length)."""
    g = torch.Generator().manual_seed(0)
    size = args.length // args.documents
    return [{"input_ids": torch.randint(3, vocab, (size,), generator=g).tolist()} for _ in range(args.steps * args.documents)]


class StepReport:
    """A ``TrainerCallback`` printing each step's time, document tokens/s, peak GPU memory, model
    TFLOP/s (``flops`` per step) and the checkpoints the ``policy`` held on the host."""

    def __init__(self, tokens: int, flops: float, cuda: bool, policy):
        from transformers import TrainerCallback

        self.tokens, self.flops, self.cuda, self.policy, self.times, self.peaks = tokens, flops, cuda, policy, [], []
        report = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if report.cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                report.policy.reset()
                report.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if report.cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - report.start
                report.times.append(seconds)
                report.peaks.append(torch.cuda.max_memory_allocated() if report.cuda else 0)
                peak = f", GPU peak {report.peaks[-1] / 2**30:.1f} GiB" if report.cuda else ""
                print(f"step {state.global_step}: {seconds:.1f} s, {report.tokens / seconds:,.0f} document tokens/s, "
                      f"{report.flops / seconds / 1e12:.1f} model TFLOP/s{peak}, "
                      f"{report.policy.host_bytes / 2**30:.2f} GiB of checkpoints on the host", flush=True)

        self.callback = _Callback()


def main(argv=None) -> dict:
    args = parse(argv)
    from peft import LoraConfig, get_peft_model

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context, measure_budget, plan_long_context
    from fm_parallel.trainer.flops import peak_tflops, step_flops

    cuda = torch.cuda.is_available()
    tile = args.tile_chunk or (16384 if cuda else 256)
    attention_chunk = args.attention_chunk or (65536 if cuda else 512)
    loss_chunk = args.loss_chunk or (4096 if cuda else 256)
    model = build_model(args, fm_hf.register(), cuda)
    config = model.config
    components = dict(tile_chunk=tile, attention_chunk=attention_chunk, compile=cuda and not args.no_compile,
                      loss_chunk=loss_chunk)
    policy = long_context(model, offload_layers=args.offload_layers if cuda else 0, **components)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    plan = None
    if args.device_gib and not cuda:
        print("--device-gib: the memory plan measures on a GPU; on the CPU the checkpoints stay where they are", flush=True)
    if args.device_gib and cuda:
        short = min(args.length, 2 * max(tile, attention_chunk, loss_chunk))
        budget = measure_budget(model, (short // 2, short))
        plan = plan_long_context(model, args.length, budget, device_gib=args.device_gib, host_gib=args.host_gib)
        print(f"memory plan for {args.device_gib:g} GiB of GPU and {args.host_gib:g} GiB of host memory: {plan}", flush=True)
        policy = long_context(model, checkpoint_every=plan.every, offload_layers=plan.offload_layers, **components)
    size = args.length // args.documents
    pairs = args.documents * size * (size + 1) // 2  # causal documents: visible (query, key) pairs per head
    flops = step_flops(config, args.length, pairs, tiled=True).total
    report = StepReport(args.length, flops, cuda, policy)
    common = dict(output_dir="/tmp/fm_hf_long_context", per_device_train_batch_size=args.documents, max_steps=args.steps,
                  learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", seed=0, bf16=cuda,
                  use_cpu=not cuda, remove_unused_columns=False, disable_tqdm=True)  # (HF's checkpointing off: ours replaces it)
    data = examples(args, config.vocab_size)
    layers = f"{config.num_hidden_layers} layers" + (" (--layers: fewer than the shape's)" if args.layers else "")
    where = torch.cuda.get_device_name() if cuda else "CPU"
    offloaded = "all on the host" if policy.offload_layers < 0 else f"the first {policy.offload_layers} layers' on the host"
    print(f"{args.trainer}: {args.model or args.shape} ({layers}), {args.length:,} tokens per step in "
          f"{args.documents} document(s), on {where}; tiles of {tile}, attention chunks of {attention_chunk}, "
          f"loss chunks of {loss_chunk}; a checkpoint every {policy.every} layer(s), {offloaded}", flush=True)
    if args.trainer == "hf":
        from transformers import Trainer, TrainingArguments

        from fm_parallel.integrations.collator import FlashMaskCollator

        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data,
                          data_collator=FlashMaskCollator(), callbacks=[report.callback])
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from trl_sft_cp import tiny_tokenizer

        trainer = SFTTrainer(model=model, args=SFTConfig(**common, padding_free=True, max_length=None),
                             processing_class=tiny_tokenizer(config.vocab_size), train_dataset=Dataset.from_list(data),
                             callbacks=[report.callback])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    warm = min(report.times[1:], default=report.times[0])
    peak = peak_tflops(where) if cuda else None
    mfu = f", {flops / warm / 1e12 / peak:.0%} MFU of {peak:.0f} TFLOP/s" if peak else ""
    planned = ""
    if plan is not None:
        planned = f"; plan {plan.device_bytes / 2**30:.1f} GiB, measured peak {max(report.peaks) / 2**30:.1f} GiB"
    print(f"summary: losses {', '.join(f'{x:.4f}' for x in losses)}; fastest step {warm:.1f} s, "
          f"{args.length / warm:,.0f} document tokens/s{mfu}{planned}")
    return {"losses": losses, "times": report.times}


if __name__ == "__main__":
    main()
