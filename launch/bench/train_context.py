"""Longest sequence the trainer itself trains, on P ranks with context parallelism (or one GPU).

    python -m launch.bench.train_context --nproc 8 --shape 8b --cp ring --start 262144          # 8 H200s
    python -m launch.bench.train_context --nproc 2 --shape tiny --cp ring --start 256 --max 1024 \\
        --device cpu --granularity 256                                                        # mechanics on a CPU

Every length tried is a fresh ``torchrun -m fm_parallel.launch`` run of the real trainer (LoRA SFT
on packed standard-library text, the byte tokenizer's vocabulary) for ``--steps`` steps, so a rank
that runs out of memory takes its process group down with it instead of leaving the others waiting
in a collective; a run that exceeds ``--timeout`` counts as not fitting. The length doubles from
``--start`` while a run succeeds, then bisects (``max_context.search_longest``). Reported per length:
tokens/s and step time of the last step, the peak memory of the fullest rank, host memory used by
offloaded checkpoints, the losses. Writes docs/benchmarks/train_context_<shape>_<cp>_x<P>.json, .md
and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.train_context")

SHAPES = {
    "tiny": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128),
    "1b": dict(hidden_size=2048, layers=16, heads=32, kv_heads=8, intermediate_size=8192),
    "8b": dict(hidden_size=4096, layers=32, heads=32, kv_heads=8, intermediate_size=14336),
}


def trainer_command(args, n: int, out: Path) -> list[str]:
    shape = SHAPES[args.shape]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "-m", "fm_parallel.launch"]
    for key, value in shape.items():
        cmd += [f"--model.{key}", str(value)]
    cmd += ["--model.tile_chunk", str(args.tile_chunk), "--model.offload_layers", str(args.offload_layers),
            "--data.objective", args.objective, "--data.seq_len", str(n), "--training.steps", str(args.steps),
            "--training.loss_chunk", str(args.loss_chunk), "--parallel.cp", args.cp, "--parallel.balance", args.balance,
            "--output.dir", str(out), "--output.checkpoint_every", "0", "--output.overwrite", "true"]
    if args.cp == "hybrid":
        cmd += ["--parallel.ulysses_degree", str(args.ulysses_degree)]
    return cmd


def try_length(args, n: int, work: Path) -> dict:
    out = work / f"n{n}"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    row = {"n": n, "shape": args.shape, "cp": args.cp, "nproc": args.nproc, "objective": args.objective,
           "offload_layers": args.offload_layers}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(trainer_command(args, n, out), capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        metrics = out / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        row["fits"] = proc.returncode == 0 and len(records) == args.steps
        if row["fits"]:
            last = records[-1]
            row.update(step_s=last["step_s"], tokens_per_s=last["tokens_per_s"], losses=[r["loss"] for r in records],
                       peak_gib=max((r.get("peak_gib", 0.0) for r in records), default=0.0),
                       host_gib=max((r.get("host_gib", 0.0) for r in records), default=0.0))
        else:
            text = proc.stderr + proc.stdout
            oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
            # The trainer's one-line user error ("error: ..."), else the first rank's exception line
            # ("[rank0]: ValueError: ..."), not torchrun's ChildFailedError.
            errors = [m.group(1) for m in re.finditer(r"^(?:\[rank\d+\]: )?error: (.+)$", text, re.M)]
            errors += [m.group(0) for m in re.finditer(r"\b\w+(?:Error|Exception): .+", text) if "ChildFailedError" not in m.group(0)]
            row["reason"] = "out of memory" if oom else f"exit {proc.returncode}: {errors[0][:200] if errors else ''}"
    except subprocess.TimeoutExpired:
        row.update(fits=False, reason=f"timeout {args.timeout:.0f} s")
    row["wall_s"] = time.perf_counter() - t0
    print(json.dumps(row), flush=True)
    return row


def write(rows: list[dict], longest: int, args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"train_context_{args.shape}_{args.cp}_x{args.nproc}"
    cmd = "python -m launch.bench.train_context " + " ".join(sys.argv[1:])
    (args.out / f"{tag}.json").write_text(json.dumps({"command": cmd, "longest": longest, "rows": rows}, indent=1))
    lines = ["| tokens | fits | step s (last step) | tokens/s (last step) | peak GiB (fullest rank) | host GiB | note |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["n"]):
        if r["fits"]:
            lines.append(f"| {r['n']} | yes | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_gib']:.1f} | {r['host_gib']:.1f} | |")
        else:
            lines.append(f"| {r['n']} | no | | | | | {r.get('reason', '')[:80]} |")
    md = "\n".join(lines)
    (args.out / f"{tag}.md").write_text(f"# Longest trainer run: {args.shape}, cp {args.cp} x {args.nproc}\n\n`{cmd}`\n\n"
                                        f"Longest that trained: **{longest}** tokens.\n\n{md}\n")
    print(md)

    from launch.bench.harness import throughput_vs_length

    ran = [(r["n"], r["tokens_per_s"]) for r in rows if r["fits"]]
    failed = [r["n"] for r in rows if not r["fits"]]
    throughput_vs_length([("tokens / s", ran, failed)], f"{args.shape}, cp {args.cp} over {args.nproc} ranks; x: did not fit",
                         args.out / f"{tag}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--shape", default="8b", choices=list(SHAPES))
    parser.add_argument("--cp", default="ring", choices=["ring", "ulysses", "hybrid", "none"])
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--balance", default="zigzag", choices=["contiguous", "zigzag", "mask"])
    parser.add_argument("--objective", default="sft", choices=["sft", "dpo"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--start", type=int, default=262144)
    parser.add_argument("--max", type=int, default=1 << 23)
    parser.add_argument("--granularity", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tile-chunk", type=int, default=16384)
    parser.add_argument("--offload-layers", type=int, default=0)
    parser.add_argument("--loss-chunk", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = parser.parse_args()
    if args.nproc < 1 or args.steps < 1:
        parser.error(f"--nproc and --steps: expected positive counts, got {args.nproc} and {args.steps}")
    from launch.bench.harness import check_device

    check_device(parser, args.device, "on a CPU pass --device cpu")  # the trainer would run on the CPU unasked

    from launch.bench.max_context import search_longest

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        def fits(n: int) -> bool:
            rows.append(try_length(args, n, Path(work)))
            return rows[-1]["fits"]

        longest, _ = search_longest(fits, args.start, args.max, args.granularity)
    write(rows, longest, args)


if __name__ == "__main__":
    main()
