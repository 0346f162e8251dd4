"""The benchmark catalogue: every maintained benchmark, by suite, behind one runner.

    python -m launch.bench.run --list                      # the table: suite, benchmark, needs, command, output
    python -m launch.bench.run --suite kernel              # every benchmark of a suite, as documented (H200)
    python -m launch.bench.run --suite cpu                 # the CPU attention benchmark (about 10 min on 2 cores)
    python -m launch.bench.run --suite cp --only ring-cpu -- --skip-run     # one benchmark, extra arguments
    python -m launch.bench.run --suite trainer --dry-run   # print the commands only

Suites: ``kernel`` (the kernels against their peers, and the plot drawn from saved runs), ``trainer``
(the trainer by attention), ``long-context`` (the longest step that fits, one GPU and P ranks), ``cp``
(context parallelism: per-layer cost, scaling over ranks, the ring planner on the CPU), ``cpu`` (the
blockwise PyTorch path against SDPA), ``tune`` (Triton block shapes). Each benchmark is its own
script under launch/bench/, run as a module from the project root (``python -m launch.bench.<name>``) in a subprocess of this interpreter (``torchrun`` for the
multi-rank ones), so its memory and its failures are its own; each writes its JSON / markdown (and a
plot) under docs/benchmarks/ unless given ``--out``. How to measure: BENCHMARKING.md.

A benchmark whose GPUs are missing is skipped, saying so. Arguments after ``--`` go to the one
benchmark selected (``--only``), after its documented ones (a later flag wins), and the device check
is then left to the script: ``-- --device cpu ...`` runs a GPU benchmark's mechanics on a CPU where
the script supports it. Exit status: 1 if a benchmark failed, 2 if none could run.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    """One entry of the catalogue (fla's ``OpConfig``): a script and the arguments of its documented run."""

    name: str
    suite: str
    script: str  # file under launch/bench/
    args: tuple[str, ...] = ()
    gpus: int = 0  # CUDA devices the documented run needs (0: a CPU is enough)
    ranks: int = 0  # > 0: started by torchrun with this many processes
    writes: str = ""  # what it writes under docs/benchmarks/
    what: str = ""

    def command(self, extra: tuple[str, ...] = (), ranks: int | None = None, python: str = "python") -> list[str]:
        """The command line, as documented (``python``) or to run (``sys.executable``)."""
        script = ["-m", f"launch.bench.{self.script.removesuffix('.py')}", *self.args, *extra]
        if self.ranks:
            launcher = ["torchrun"] if python == "python" else [python, "-m", "torch.distributed.run", "--standalone"]
            return [*launcher, "--nproc_per_node", str(ranks or self.ranks), *script]
        return [python, *script]


KERNEL_RUNS = ("docs/benchmarks/kernel_h200_cute_causal_docs_dpo.json", "docs/benchmarks/kernel_h200_cute_sliding_prefix.json",
               "docs/benchmarks/kernel_h200_order.json", "docs/benchmarks/kernel_h200.json")

CATALOGUE = (
    Benchmark("kernel", "kernel", "kernel.py", gpus=1, writes="kernel_h200.json / .md / .png",
              what="CuTe and Triton backends vs FA4, Flex (both backends), SDPA; 8k-1M, mask preparation, new-mask churn"),
    Benchmark("kernel-plot", "kernel", "plot_kernel.py", KERNEL_RUNS, writes="kernel_h200.png",
              what="TFLOP/s against N per mask, drawn from saved runs (newest first)"),
    Benchmark("trainer", "trainer", "trainer_attention.py", gpus=1, writes="trainer_h200.json / .md",
              what="the trainer's tokens/s with FlashMask vs Flex vs SDPA + dense mask, 1B at 32k-128k"),
    Benchmark("max-context", "long-context", "max_context.py", ("--models", "1b", "8b"), gpus=1,
              writes="max_context.json / .md / .png, max_context_shapes.png", what="longest LoRA step that fits on one GPU, by attention and model shape"),
    Benchmark("one-layer-input", "long-context", "one_layer_input.py", ("--config", "launch/configs/h200_8b_1m.toml"), gpus=1,
              writes="(prints JSON lines; --out FILE)", what="the memory plan's one-layer lines, the layer input made three ways"),
    Benchmark("train-context", "long-context", "train_context.py",
              ("--nproc", "8", "--shape", "8b", "--cp", "ring", "--start", "262144"), gpus=8,
              writes="train_context_8b_ring_x8.json / .md / .png", what="longest sequence the trainer trains on P ranks with CP"),
    Benchmark("cp-layer-cost", "cp", "cp_layer_cost.py", gpus=1, writes="cp_scaling_model_<gpu>.json / .md",
              what="one CP layer's kernel / host / copy time per rank on one GPU, modelled for P = 2, 4, 8"),
    Benchmark("cp-scaling", "cp", "cp_scaling.py", gpus=8, ranks=8, writes="cp_scaling_cuda_x8.json / .md / .png",
              what="ring, Ulysses, hybrid TFLOP/s per GPU against one GPU, bytes moved, imbalance"),
    Benchmark("ring-cpu", "cp", "ring_cpu.py", writes="ring_cpu.json / .md",
              what="the ring planner (transfers, bytes, imbalance for P = 4..64) and 4 gloo ranks"),
    Benchmark("cpu-attention", "cpu", "cpu_attention.py", writes="cpu_attention.json / .md / .png",
              what="blockwise PyTorch path vs SDPA with a dense bool mask, N = 2k-16k, time and peak memory"),
    Benchmark("tune-triton", "tune", "tune_triton.py", ("--d", "128", "--n", "16384"), gpus=1, writes="tune_triton.json",
              what="every candidate block shape of the three Triton passes, timed"),
    Benchmark("tune-triton-static", "tune", "tune_triton.py", ("--static", "--json", "docs/benchmarks/triton_static_sm90.json"),
              writes="triton_static_sm90.json", what="registers, spills, shared memory per block shape for sm_90a, no GPU"),
)
SUITES = tuple(dict.fromkeys(b.suite for b in CATALOGUE))


def table() -> str:
    """The catalogue as a markdown table (``--list``; docs/benchmarks/README.md holds the same)."""
    lines = ["| suite | benchmark | needs | command | writes under docs/benchmarks/ | what |", "|---|---|---|---|---|---|"]
    for b in CATALOGUE:
        needs = f"{b.gpus} GPU{'s' if b.gpus > 1 else ''}" if b.gpus else "CPU"
        lines.append(f"| {b.suite} | {b.name} | {needs} | `{shlex.join(b.command())}` | {b.writes} | {b.what} |")
    return "\n".join(lines)


def select(parser: argparse.ArgumentParser, suite: str, only: list[str] | None) -> list[Benchmark]:
    chosen = [b for b in CATALOGUE if b.suite == suite]
    if only:
        names = {b.name for b in chosen}
        unknown = [n for n in only if n not in names]
        if unknown:
            parser.error(f"--only: expected benchmarks of suite {suite!r} ({', '.join(sorted(names))}), got {', '.join(unknown)}")
        chosen = [b for b in chosen if b.name in only]
    return chosen


def gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the catalogue (markdown) and exit")
    parser.add_argument("--suite", choices=SUITES, help="run every benchmark of this suite")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="of the suite, only these benchmarks")
    parser.add_argument("--nproc", type=int, help="processes for the torchrun benchmarks (default: their documented count)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.list:
        print(table())
        return 0
    if not args.suite:
        parser.error("--suite: expected one of " + ", ".join(SUITES) + " (or --list)")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc: expected at least 1, got {args.nproc}")
    chosen = select(parser, args.suite, args.only)
    if extra and len(chosen) != 1:
        parser.error(f"arguments after --: expected one benchmark selected with --only, got {len(chosen)} "
                     f"({', '.join(b.name for b in chosen)})")
    have = None if args.dry_run or extra else gpus_here()
    ran, failed = 0, []
    for b in chosen:
        shown = shlex.join(b.command(tuple(extra), args.nproc))
        if have is not None and have < b.gpus:
            print(f"skipped {b.name}: needs {b.gpus} CUDA GPU(s), found {have} ({shown})", flush=True)
            continue
        print(f"== {b.name}: {shown}", flush=True)
        if args.dry_run:
            continue
        ran += 1
        code = subprocess.run(b.command(tuple(extra), args.nproc, python=sys.executable), cwd=ROOT).returncode
        if code:
            failed.append(f"{b.name} (exit {code})")
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    if not ran and not args.dry_run:
        print(f"error: no benchmark of suite {args.suite!r} can run here", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
