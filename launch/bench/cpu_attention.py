"""CPU benchmark: the blockwise PyTorch path (impl="torch") against SDPA with a dense bool mask.

    python -m launch.bench.cpu_attention                     # N = 2k..16k, about 10 minutes on 2 cores
    python -m launch.bench.cpu_attention --n 2048 4096 --quick

Masks: packed causal documents (lengths drawn from an exponential law of mean 512, fixed seed) and
DPO (prompt N/2, chosen N/4, rejected N/4). B=1, H=4, D=64, float32. Every configuration runs in its
own subprocess so that its peak memory is its own: peak RSS while building the mask and running
attention, minus the RSS with q/k/v (and dO) already allocated. Time is the median of repeated
calls with the mask already built. An autograd-through-checkpointed-tiles backward ("torch-ckpt")
was measured beside them until 35eb2ec: 2.5-3x slower forward+backward than our own recompute
(docs/benchmarks/cpu_attention.md); it is no longer run.

Writes docs/benchmarks/cpu_attention.json, docs/benchmarks/cpu_attention.md and cpu_attention.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the launch.bench imports need the project root on sys.path
    raise SystemExit("run it from the project root as a module: python -m launch.bench.cpu_attention")

from launch.bench.harness import spread

OUT = ROOT / "docs" / "benchmarks"
IMPLS = ("torch", "sdpa-dense")
MASKS = ("docs512", "dpo")
MODES = ("fwd", "fwd+bwd")


# ------------------------------------------------------------------ worker
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def doc_lengths(n: int, mean: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < n:
        lengths.append(max(1, round(rng.expovariate(1 / mean))))
    lengths[-1] -= sum(lengths) - n
    return lengths


def build_mask(name: str, n: int):
    from fm_parallel import masks

    if name == "docs512":
        return masks.document(doc_lengths(n, 512))
    return masks.dpo(n // 2, n // 4, n - n // 2 - n // 4)


def worker(kind: str, impl: str, mask_name: str, n: int, mode: str, reps: int) -> dict:
    """kind "memory": peak RSS of one call above the inputs; kind "time": median time of `reps` calls."""
    import torch
    import torch.nn.functional as F

    from fm_parallel import flashmask_attention

    torch.manual_seed(0)
    h, d = 4, 64
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(1, h, n, d, requires_grad=grad) for _ in range(3))
    dout = torch.randn(1, h, n, d)

    def prepare():
        m = build_mask(mask_name, n)
        return m.to_dense() if impl == "sdpa-dense" else m

    def run(m):
        if impl == "sdpa-dense":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        else:
            out = flashmask_attention(q, k, v, mask=m, impl="torch")
        if grad:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
        return out

    # A first full-size call loads libraries and kernels (tens of MiB of code pages and pools) that
    # are not attention memory.
    run(prepare())
    if kind == "memory":
        # With MALLOC_MMAP_THRESHOLD_ fixed (see run_config) freed buffers went back to the OS, so
        # the measured call starts from a clean baseline.
        base = _rss_kib("VmRSS")
        _reset_peak()
        run(prepare())
        return {"peak_mib": (_rss_kib("VmHWM") - base) / 1024}
    m = prepare()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(m)
        times.append(time.perf_counter() - t0)
    ms = spread(1e3 * t for t in times)
    return {"time_ms": ms["median"], "time_ms_min": ms["min"], "time_ms_max": ms["max"],
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------ driver
def run_config(impl, mask_name, n, mode, reps) -> dict:
    row = {"impl": impl, "mask": mask_name, "n": n, "mode": mode, "heads": 4, "head_dim": 64}
    for kind in ("time", "memory"):
        cmd = [sys.executable, "-m", "launch.bench.cpu_attention", "--worker", kind, impl, mask_name, str(n), mode, str(reps)]
        env = dict(os.environ)
        if kind == "memory":
            # Every allocation of 64 KiB or more is its own mmap, unmapped on free: peak RSS then
            # tracks live tensors. (It slows allocation down, hence separate timing runs.)
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode:
            row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return row
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def io_mib(row: dict) -> float:
    """Memory every implementation must hold: the output, and for fwd+bwd the q/k/v gradients too."""
    tensors = 4 if row["mode"] == "fwd+bwd" else 1
    return tensors * row["n"] * row["heads"] * row["head_dim"] * 4 / 2**20


def table(rows: list[dict]) -> str:
    lines = [
        "| mask | N | mode | torch ms min / median / max | SDPA dense ms | speed-up vs SDPA "
        "| torch peak MiB | SDPA peak MiB | workspace ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    key = {(r["impl"], r["mask"], r["n"], r["mode"]): r for r in rows}
    nan = float("nan")
    for mask_name in MASKS:
        for n in sorted({r["n"] for r in rows}):
            for mode in MODES:
                t, s = (key.get((i, mask_name, n, mode), {}) for i in IMPLS)
                if "time_ms" not in t:
                    continue
                speed = s["time_ms"] / t["time_ms"] if "time_ms" in s else nan
                # Workspace: peak above what every implementation must hold (output, gradients).
                ws = (s["peak_mib"] - io_mib(s)) / max(t["peak_mib"] - io_mib(t), 0.5) if "peak_mib" in s else nan
                lines.append(
                    f"| {mask_name} | {n} | {mode} | {t.get('time_ms_min', nan):.0f} / {t['time_ms']:.0f} / "
                    f"{t.get('time_ms_max', nan):.0f} | "
                    f"{s.get('time_ms', nan):.0f} | {speed:.1f}x | {t['peak_mib']:.0f} | "
                    f"{s.get('peak_mib', nan):.0f} | {ws:.0f}x |"
                )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, style in zip(IMPLS, ("o-", "^:")):
        for mask_name, color in zip(MASKS, ("C0", "C1")):
            pts = sorted((r["n"], r) for r in rows if r["impl"] == impl and r["mask"] == mask_name
                         and r["mode"] == "fwd+bwd" and "time_ms" in r)
            if not pts:
                continue
            ns = [p[0] for p in pts]
            axes[0].plot(ns, [p[1]["time_ms"] for p in pts], style, color=color, label=f"{impl} {mask_name}")
            axes[1].plot(ns, [p[1]["peak_mib"] for p in pts], style, color=color, label=f"{impl} {mask_name}")
    for ax, label in zip(axes, ("forward+backward time (ms)", "peak attention memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("CPU, B=1 H=4 D=64 float32: blockwise FlashMask vs SDPA with a dense bool mask")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, impl, mask_name, n, mode, reps = sys.argv[2:8]
        print(json.dumps(worker(kind, impl, mask_name, int(n), mode, int(reps))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    parser.add_argument("--quick", action="store_true", help="one timed repetition instead of three")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from tqdm import tqdm

    configs = [(i, m, n, mode) for m in args.masks for n in args.n for mode in MODES for i in IMPLS]
    rows = []
    for impl, mask_name, n, mode in tqdm(configs, desc="cpu_attention", unit="config"):
        reps = 1 if args.quick or n >= 16384 else 3
        rows.append(run_config(impl, mask_name, n, mode, reps))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m launch.bench.cpu_attention " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d")}
    (args.out / "cpu_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows)
    plot(rows, args.out / "cpu_attention.png")
    (args.out / "cpu_attention.md").write_text(
        f"# CPU attention benchmark\n\n`{meta['command']}` on {meta['cpus']} CPU cores, {meta['date']}. "
        "B=1, H=4, D=64, float32; docs512 = packed causal documents of mean length 512; "
        "dpo = prompt N/2, chosen N/4, rejected N/4. Peak = peak RSS of mask building + attention above "
        "the inputs; workspace ratio = SDPA's peak over ours after subtracting from each what every "
        "implementation must hold (the output, and for fwd+bwd the three gradients).\n\n" + md + "\n\n![time and memory](cpu_attention.png)\n"
    )
    print(md)
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"FAILED {r['impl']} {r['mask']} N={r['n']} {r['mode']}: {r['error']}")


if __name__ == "__main__":
    main()
