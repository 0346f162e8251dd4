"""The trainer's throughput with FlashMask against the same run with SDPA + a dense mask and with FlexAttention.

    python -m launch.bench.trainer_attention                                   # on the H200: 1B-class, 32k-128k
    python -m launch.bench.trainer_attention --shape tiny --lengths 512 --attention flashmask sdpa --timed-steps 1 \\
        --out /tmp/bench                                                       # mechanics check on a CPU
    python -m launch.bench.trainer_attention --objective dpo --attention flashmask --name trainer_dpo_h200
                                            # DPO: shared prompt vs TRL's layout (the prompt twice)
    python -m launch.bench.trainer_attention --objective dpo --attention flashmask --dpo-sample 1024 1024 \
        --lengths 16384 65536 --name trainer_dpo_h200_1to1   # prompt : response 1 : 1

Each run is the real trainer (``fm_parallel.trainer.loop.train``): LoRA SFT on packed standard-library
text (byte tokenizer), one row of ``seq_len`` tokens per step, no context parallelism, per-layer
activation checkpointing, sequence-tiled layers, chunked loss. Only the attention differs: ``model.attention``
flashmask (our kernel, O(N) mask), sdpa (an N x N boolean mask, which is what SDPA needs for packed
documents) or flex (a BlockMask built from the same mask). The first step (compilation, autotuning)
is not timed; then ``--timed-steps`` steps (8 by default) run on the same rows for every attention (the
data stream is deterministic), and tokens/s is their trained tokens (a row's padding left out) over their total time (not a mean of
per-step rates, which weighs short steps up); step times are reported as min / median / max. Runs share
one process, so a run that does not fit is reported and the next one goes on. A row whose mask needs a
kernel no earlier row needed compiles it inside a timed step (at 64k the first one-document row compiled
FA4's causal kernel: 8.1 s instead of 4.0 s); ``--warm-pass`` runs each configuration once untimed on
the same rows first, so that the timed steps hold only training (a real run pays those compiles once).

``--objective dpo`` trains LoRA DPO instead, once per ``--dpo-layouts``: ``shared`` (one prompt per
sample, the ``dpo`` mask) and ``separate`` (TRL's layout: ``[prompt, chosen]`` and ``[prompt,
rejected]`` as two causal documents, the prompt computed twice). The samples are the same and the
losses equal (tested); a row holds fewer samples in the separate layout, so the figure that compares
them is samples per second (and sample tokens per second, ``prompt + chosen + rejected`` per sample).

Writes docs/benchmarks/<--name>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.trainer_attention")

SHAPES = {
    "tiny": ["--model.hidden_size", "64", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
             "--model.intermediate_size", "128"],
    "1b": ["--model.hidden_size", "2048", "--model.layers", "16", "--model.heads", "32", "--model.kv_heads", "8",
           "--model.intermediate_size", "8192"],
}


def write_dpo_samples(path: Path, prompt: int, response: int, count: int = 4096) -> Path:
    """A JSONL of ``count`` DPO samples of exactly ``prompt`` and ``response`` byte tokens each (the
    trainer's byte tokenizer): a standard-library file's opening as the prompt, its continuation as
    chosen, another file's text at the same place as rejected. ASCII openings only, so a character is
    one token."""
    from fm_parallel.trainer.data import stdlib_texts

    if prompt < 1 or response < 1:
        raise SystemExit(f"--dpo-sample: expected PROMPT >= 1 and RESPONSE >= 1 tokens, got {prompt} {response}")
    need = prompt + response
    texts = [t[:need] for t in stdlib_texts() if len(t) >= need and t[:need].isascii()]
    if len(texts) < 2:
        raise SystemExit(f"--dpo-sample: fewer than two standard-library files hold {need} ASCII characters")
    with path.open("w") as f:
        for i in range(count):
            text, other = texts[i % len(texts)], texts[(i + 1) % len(texts)]
            f.write(json.dumps({"prompt": text[:prompt], "chosen": text[prompt:], "rejected": other[prompt:]}) + "\n")
    return path


def dpo_work(n: int, layout: str, steps: int, path: str = "") -> list[tuple[int, int]]:
    """(samples, sample tokens) of the rows of each step after the first: what the trainer reads
    (one row per step, the deterministic built-in stream or ``path``)."""
    from itertools import islice

    from fm_parallel.trainer.data import ByteTokenizer, dpo_rows

    work = []
    for row in islice(dpo_rows(n, ByteTokenizer(), path, layout), 1, steps + 1):
        samples = int(row.sample.max()) + 1
        prompt_twice = int(((row.segment == 0) & (row.sample >= 0)).sum())
        tokens = int((row.sample >= 0).sum()) - (prompt_twice // 2 if layout == "separate" else 0)
        work.append((samples, tokens))
    return work


def one_run(shape: str, attention: str, n: int, args, work: Path, layout: str | None = None) -> dict:
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    out = work / f"{shape}_{attention}_{n}_{layout}"
    dpo = ["--data.objective", "dpo", "--data.dpo_layout", layout, "--data.path", args.dpo_path] if layout else []
    if args.objective == "rm":
        dpo = ["--data.objective", "rm"]  # the built-in pairs, packed shared-prompt rows
    dpo += ["--model.finetune", args.finetune]
    cfg = load_config(SHAPES[shape] + dpo + [
        "--model.attention", attention, "--model.tile_chunk", str(args.tile_chunk), "--data.seq_len", str(n),
        "--training.steps", str(args.timed_steps + 1), "--training.loss_chunk", str(args.loss_chunk), "--parallel.cp", "none",
        "--output.dir", str(out), "--output.checkpoint_every", "0", "--output.overwrite", "true"], environ={})
    row = {"shape": shape, "attention": attention if layout is None else f"{attention}/{layout}", "seq_len": n}
    t0 = time.perf_counter()
    try:
        train(cfg)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        timed = records[1:]
        if len(timed) != args.timed_steps:
            raise RuntimeError(f"expected {args.timed_steps} timed steps, the run logged {len(timed)}")
        times = [r["step_s"] for r in timed]
        trained = sum(n - r.get("padding_tokens", 0) for r in timed)  # tokens trained on: a row's padding is not
        row.update(fits=True, tokens_per_s=trained / sum(times), padding_tokens=n * len(timed) - trained,
                   step_s=statistics.median(times),
                   step_s_min=min(times), step_s_max=max(times), timed_steps=len(timed), timed_step_s=times, first_step_s=records[0]["step_s"],
                   losses=[r["loss"] for r in records], peak_gib=max((r.get("peak_gib", 0.0) for r in records), default=0.0))
        if layout is not None:
            done = dpo_work(n, layout, len(timed), args.dpo_path)
            row.update(samples_per_s=sum(w[0] for w in done) / sum(times),
                       sample_tokens_per_s=sum(w[1] for w in done) / sum(times), samples_per_step=[w[0] for w in done])
    except Exception as e:  # noqa: BLE001 - a baseline that runs out of memory is a result, not a crash
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        row.update(fits=False, error=f"{type(e).__name__}: {text}")
    row["wall_s"] = time.perf_counter() - t0
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def write(rows: list[dict], args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m launch.bench.trainer_attention " + " ".join(sys.argv[1:])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (args.out / f"{args.name}.json").write_text(json.dumps({"command": cmd, "device": device, "rows": rows}, indent=1))
    dpo = args.objective == "dpo"
    # The reference of each comparison: FlashMask (SFT), the shared-prompt layout with FlashMask (DPO).
    ours_name = "flashmask/shared" if dpo else "flashmask"
    rate = "samples_per_s" if dpo else "tokens_per_s"
    ours = {(r["shape"], r["seq_len"]): r for r in rows if r["attention"] == ours_name and r["fits"]}
    extra = " samples/s | sample tokens/s |" if dpo else ""
    lines = [f"| model | seq_len | attention | tokens/s (trained tokens / time, no padding) |{extra} step s min / median / max | first step s | "
             f"peak GiB | {ours_name} speed-up |", "|---|---|---|---|" + ("---|---|" if dpo else "") + "---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['shape']} | {r['seq_len']} | {r['attention']} | did not run: {r['error'][:80]} |"
                         + (" | |" if dpo else "") + " | | | |")
            continue
        ref = ours.get((r["shape"], r["seq_len"]))
        speedup = f"{ref[rate] / r[rate]:.2f}x" if ref and r["attention"] != ours_name else ""
        cells = f" {r['samples_per_s']:.2f} | {r['sample_tokens_per_s']:.0f} |" if dpo else ""
        lines.append(f"| {r['shape']} | {r['seq_len']} | {r['attention']} | {r['tokens_per_s']:.0f} |{cells} "
                     f"{r['step_s_min']:.2f} / {r['step_s']:.2f} / {r['step_s_max']:.2f} | "
                     f"{r['first_step_s']:.1f} | {r['peak_gib']:.1f} | {speedup} |")
    md = "\n".join(lines)
    (args.out / f"{args.name}.md").write_text(f"# Trainer throughput by attention ({device})\n\n`{cmd}`\n\n{md}\n")
    print(md)

    from launch.bench.harness import throughput_vs_length

    labels = list(dict.fromkeys(r["attention"] for r in rows))
    series = [(label, [(r["seq_len"], r[rate]) for r in rows if r["attention"] == label and r["fits"]],
               [r["seq_len"] for r in rows if r["attention"] == label and not r["fits"]]) for label in labels]
    title = (f"LoRA DPO (samples/s), shared prompt vs TRL's layout, {args.shape} ({device})" if dpo
             else f"LoRA SFT, packed documents, {args.shape} ({device})")
    throughput_vs_length(series, f"{title}; x: did not run", args.out / f"{args.name}.png")


def main() -> None:
    from fm_parallel.trainer.data import DPO_LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1b", choices=list(SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[32768, 65536, 131072])
    parser.add_argument("--attention", nargs="+", default=["flashmask", "flex", "sdpa"], choices=["flashmask", "flex", "sdpa"])
    parser.add_argument("--sdpa-max", type=int, default=65536, help="longest row for the dense-mask baseline (its step is O(N^2))")
    parser.add_argument("--timed-steps", type=int, default=8, help="steps timed after the untimed first one")
    parser.add_argument("--loss-chunk", type=int, default=8192)
    parser.add_argument("--tile-chunk", type=int, default=16384)
    parser.add_argument("--objective", default="sft", choices=["sft", "dpo", "rm"])
    parser.add_argument("--finetune", default="lora", choices=["lora", "full"],
                        help="lora, or full: every weight trained (FSDP2, one process here)")
    parser.add_argument("--dpo-layouts", nargs="+", default=list(DPO_LAYOUTS), choices=DPO_LAYOUTS)
    parser.add_argument("--dpo-sample", nargs=2, type=int, metavar=("PROMPT", "RESPONSE"),
                        help="DPO samples of exactly these prompt / response token counts (default: the built-in "
                             "samples, prompt 64, responses 96 at long rows)")
    parser.add_argument("--warm-pass", action="store_true",
                        help="run every configuration once untimed first, on the same rows: kernels that a later row "
                             "first needs (FA4's causal kernel on the first one-document row, say) compile there, not "
                             "in a timed step (doubles the time; each row of the JSON says warm_pass)")
    parser.add_argument("--name", default="trainer_h200")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    if args.dpo_sample and args.objective != "dpo":
        parser.error("--dpo-sample: expected with --objective dpo (it sizes DPO samples), got --objective sft")
    if args.timed_steps < 1:
        parser.error(f"--timed-steps: expected at least 1 (8 for a reported number), got {args.timed_steps}")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        args.dpo_path = str(write_dpo_samples(Path(work) / "dpo.jsonl", *args.dpo_sample)) if args.dpo_sample else ""
        for n in args.lengths:
            for attention in args.attention:
                if attention == "sdpa" and n > args.sdpa_max:
                    continue
                for layout in (args.dpo_layouts if args.objective == "dpo" else [None]):
                    if args.warm_pass:  # the same rows, untimed: every compile this configuration needs
                        one_run(args.shape, attention, n, args, Path(work), layout)
                    row = one_run(args.shape, attention, n, args, Path(work), layout)
                    row["warm_pass"] = args.warm_pass
                    rows.append(row)
                    write(rows, args)


if __name__ == "__main__":
    main()
