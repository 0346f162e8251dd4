"""Longest sequence at which one LoRA training step fits: FlashMask against SDPA with a dense mask and FlexAttention.

    python launch/bench/max_context.py --models 1b 8b                      # on the H200
    python launch/bench/max_context.py --models tiny --device cpu --max 8192  # mechanics check on a CPU

For each model shape (random weights, bf16 on GPU, LoRA rank 16 on the attention projections) and
each attention implementation, the length doubles from --start while a step fits, then bisects
between the last length that fit and the first that did not (to --granularity tokens). A step is one
forward + backward + AdamW step on one row of packed documents (mean length 2048) with the trainer's
memory switches: per-layer activation checkpointing (inputs offloaded to the host with --offload),
tiled MLP, chunked loss. Every length tried is reported with peak memory, step time and tokens/s.

Writes docs/benchmarks/max_context.json and max_context.md (and a plot).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab=258),
    "1b": dict(hidden_size=2048, layers=16, heads=32, kv_heads=8, intermediate_size=8192, vocab=128256),
    "8b": dict(hidden_size=4096, layers=32, heads=32, kv_heads=8, intermediate_size=14336, vocab=128256),
}
IMPLS = ("flashmask", "sdpa_dense", "flex")


def search_longest(fits, start: int, maximum: int, granularity: int) -> tuple[int, list[int]]:
    """Doubling from ``start`` while ``fits(n)``, then bisection: the longest fitting length (0 if even
    ``start`` fails) and every length tried, in order."""
    tried: list[int] = []

    def check(n):
        tried.append(n)
        return fits(n)

    if not check(start):
        return 0, tried
    good, bad = start, None
    while good * 2 <= maximum:
        if check(good * 2):
            good *= 2
        else:
            bad = good * 2
            break
    while bad is not None and bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        if check(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def _model(shape: str, impl: str, device, dtype, args):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    s = SHAPES[shape]
    attn = {"flashmask": fm_hf.register(), "sdpa_dense": "sdpa", "flex": "flex_attention"}[impl]
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=1 << 22, attn_implementation=attn, use_cache=False)
    with torch.device(device):
        base = LlamaForCausalLM(cfg).to(dtype)
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable({"use_reentrant": False}, offload=args.offload)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.tiled_mlp:
        from fm_parallel.trainer.loop import _tile_mlps

        _tile_mlps(base, args.tiled_mlp)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    return model


def _step(model, impl: str, n: int, device, args) -> float:
    """One training step on a packed row of ``n`` tokens; returns its time in seconds."""
    import torch.nn.functional as F

    from fm_parallel import masks
    from fm_parallel.trainer.loop import _chunked

    lens = masks.sample_lengths(n)
    mask = masks.document(lens).to(device)
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(0, vocab, (1, n), device=device)
    labels = torch.roll(ids, -1, 1)
    kwargs = {"position_ids": torch.arange(n, device=device).view(1, n)}
    if impl == "flashmask":
        kwargs["flashmask"] = mask
    elif impl == "sdpa_dense":
        kwargs["attention_mask"] = mask.to_dense()  # [1, 1, n, n] bool: the N x N mask this baseline needs
    else:
        kwargs["attention_mask"] = masks.to_block_mask(mask, _compile=True)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    t0 = time.perf_counter()
    hidden = model.get_base_model().model(input_ids=ids, **kwargs).last_hidden_state
    head = model.get_base_model().lm_head
    loss = _chunked(head, hidden, labels, args.loss_chunk,
                    lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")) / n
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower() or "allocate" in str(e).lower()


def run(shape: str, impl: str, device, dtype, args) -> dict:
    rows: list[dict] = []
    model = _model(shape, impl, device, dtype, args)

    def fits(n: int) -> bool:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row = {"model": shape, "impl": impl, "n": n}
        try:
            seconds = _step(model, impl, n, device, args)
            row.update(fits=True, step_s=seconds, tokens_per_s=n / seconds)
        except Exception as e:  # noqa: BLE001 - out of memory is the answer we look for; others are reported
            if not _is_oom(e):
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            row["fits"] = False
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rows.append(row)
        print(json.dumps(row), flush=True)
        model.zero_grad(set_to_none=True)
        return row["fits"]

    longest, _ = search_longest(fits, args.start, args.max, args.granularity)
    del model
    return {"model": shape, "impl": impl, "longest": longest, "tried": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["1b", "8b"], choices=list(SHAPES))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start", type=int, default=8192)
    parser.add_argument("--max", type=int, default=1 << 21)
    parser.add_argument("--granularity", type=int, default=16384)
    parser.add_argument("--loss-chunk", type=int, default=8192)
    parser.add_argument("--tiled-mlp", type=int, default=16384, help="MLP sequence chunk (0: off)")
    parser.add_argument("--offload", action="store_true", help="offload checkpointed layer inputs to the host (GPU)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = [run(m, i, device, dtype, args) for m in args.models for i in args.impls]
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = "python launch/bench/max_context.py " + " ".join(sys.argv[1:])
    (args.out / "max_context.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1))
    lines = ["| model | attention | longest step that fits | peak GiB there | tokens/s there |", "|---|---|---|---|---|"]
    for r in results:
        at = [t for t in r["tried"] if t["n"] == r["longest"] and t["fits"]]
        peak = f"{at[0]['peak_gib']:.1f}" if at and "peak_gib" in at[0] else "-"
        tps = f"{at[0]['tokens_per_s']:.0f}" if at else "-"
        lines.append(f"| {r['model']} | {r['impl']} | {r['longest']} | {peak} | {tps} |")
    md = "\n".join(lines)
    (args.out / "max_context.md").write_text(f"# Longest LoRA step\n\n`{cmd}`\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
