"""Block shapes of the three Triton FlashMask kernels: the GPU sweep, and a static report without a GPU.

    python -m launch.bench.tune_triton --d 128 --n 16384 --out docs/benchmarks      # H200: time every candidate
    python -m launch.bench.tune_triton --d 64 256 --tag tune_triton_d64_d256        # shapes spilling > 512 B skipped
    python -m launch.bench.tune_triton --static --json docs/benchmarks/triton_static_sm90.json   # any machine

Sweep (CUDA): for each pass (forward, dK/dV, dQ) and each candidate (BLOCK_M, BLOCK_N, num_warps,
num_stages) it times that kernel alone on causal and packed-document masks (B=1, H=16, bf16) and
reports effective TFLOP/s (visible pairs only; forward = 2 matmuls, dK/dV = 4, dQ = 3), min / median /
max of ``triton.testing.do_bench``. The candidate reaches the launchers through
``fm_parallel.kernels.triton.backend.config_for``, which they read at every call. The winners go into the Hopper table
of kernels/triton/backend.py.

``--static`` (no GPU): Triton compiles for ``sm_90a`` (``triton.compile`` with a ``GPUTarget``), and the
``ptxas`` it ships reports each kernel's registers per thread and spilled bytes (``-v``). A shape that
spills, or whose shared memory passes the 227 KiB a Hopper block may use, will be slow or will not
launch: this prunes the sweep (candidates plus the current choices, marked ``*``) before device time is
spent; the sweep itself skips shapes spilling more than ``--max-spill``. It measures no speed. The local
Triton may differ from the GPU image's (3.6): the report names the version it used. Registers alone
do not discriminate: ptxas fills the 255 a thread may have even for a plain flash-attention forward
(no mask, one loop), compiled here as the ``reference`` row. Spills do.

Was two scripts importing each other (tune_triton.py, triton_static.py at 45f30b8; issue 32.3).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
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
    raise SystemExit("run it from the project root as a module: python -m launch.bench.tune_triton")

CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3)],
    "bwd_kv": [(64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (128, 128, 8, 2)],
    "bwd_q": [(128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 3)],
}
# Shapes that compile without spills at these head dims (--static, Triton 3.9, docs/benchmarks/README.md):
# tried on top of CANDIDATES there.
EXTRA = {
    128: {"fwd": [(64, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3)], "bwd_kv": [(32, 64, 8, 2), (32, 32, 4, 2)],
          "bwd_q": [(64, 64, 8, 2), (128, 64, 8, 1)]},
    256: {"fwd": [(32, 32, 4, 2), (64, 32, 8, 2), (64, 32, 4, 2)], "bwd_kv": [(32, 32, 8, 2), (16, 32, 4, 2)],
          "bwd_q": [(32, 32, 8, 2), (32, 64, 8, 2)]},
}
MATMULS = {"fwd": 2, "bwd_kv": 4, "bwd_q": 3}
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on H100 / H200
_PTRS = {"LSE": "*fp32", "DELTA": "*fp32", "DQ_ACC": "*fp32", "FMS": "*i32", "FME": "*i32", "POS": "*i32",
         "FULL_OFF": "*i32", "FULL_RUNS": "*i32", "PART_OFF": "*i32", "PART_RUNS": "*i32", "ORDER": "*i32"}
_FLOATS = {"qk_scale", "scale"}


def _plain_forward():
    """A plain flash-attention forward (one loop, no mask): the calibration row."""
    import triton
    import triton.language as tl

    @triton.jit
    def plain_fwd(Q, K, V, O, stride_h, stride_n, n_keys, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  M_INT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, WIDE: tl.constexpr):
        pid_m, h = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + h * stride_h + offs_m[:, None] * stride_n + offs_d[None, :])
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kt = tl.load(K + h * stride_h + offs_n[None, :] * stride_n + offs_d[:, None])
            v = tl.load(V + h * stride_h + offs_n[:, None] * stride_n + offs_d[None, :])
            s = tl.dot(q, kt) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
            m_i = m_new
        tl.store(O + h * stride_h + offs_m[:, None] * stride_n + offs_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))

    return plain_fwd


def _signature(kernel, constexprs: dict) -> dict:
    """Argument types as the launchers pass them: bf16 tensors, int32 bounds and plans, int32 sizes."""
    sig = {}
    for p in kernel.params:
        if p.name in constexprs:
            sig[p.name] = "constexpr"
        elif p.name in _PTRS:
            sig[p.name] = _PTRS[p.name]
        elif p.name in _FLOATS:
            sig[p.name] = "fp32"
        elif p.name.isupper() or p.name == "DV_OUT":
            sig[p.name] = "*bf16"
        else:
            sig[p.name] = "i32"
    return sig


def resources(kind: str, d: int, shape: tuple[int, int, int, int]) -> dict:
    """Compile one pass at one block shape for sm_90a; ptxas's registers / spills and Triton's shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fm_parallel.kernels.triton import kernels as tk

    kernels = {"fwd": tk.flashmask_fwd_kernel, "bwd_kv": tk.flashmask_bwd_kv_kernel, "bwd_q": tk.flashmask_bwd_q_kernel}
    kernel = _plain_forward() if kind == "reference" else kernels[kind]
    block_m, block_n, warps, stages = shape
    const = dict(D=d, DV=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(d), BLOCK_M=block_m,
                 BLOCK_N=block_n, M_INT=1, UPCAST=False, PREC="tf32", WIDE=False)
    src = ASTSource(fn=kernel, signature=_signature(kernel, const),
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    row = {"pass": kind, "d": d, "block_m": block_m, "block_n": block_n, "num_warps": warps, "num_stages": stages,
           "shared_bytes": compiled.metadata.shared, "compile_s": round(time.perf_counter() - t0, 1)}
    # ptxas -v on the PTX Triton emitted: the newest bundled ptxas that accepts its PTX version.
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        proc = None
        for tool in (bundled / "ptxas-blackwell", bundled / "ptxas"):  # the former only in newer Triton
            if not tool.exists():
                continue
            proc = subprocess.run([str(tool), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"no bundled ptxas under {bundled} accepted the PTX"
                               + (f": {proc.stderr.strip()[:200]}" if proc else ""))
        out = proc.stdout + proc.stderr
    row["registers"] = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    row["spill_store_bytes"], row["spill_load_bytes"] = int(spill.group(1)), int(spill.group(2))
    row["fits"] = row["shared_bytes"] <= SMEM_LIMIT and row["spill_store_bytes"] == 0
    return row


def static_report(args) -> None:
    """Compile every (pass, head dim, shape) for sm_90a and print / write registers, spills and shared memory."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter has no compiler to report on (and config_for's real table)
    import triton
    from tqdm import tqdm

    from fm_parallel.kernels.triton.backend import config_for

    extra = args.extra
    jobs = [("reference", d, shape, False) for d in args.d for shape in ((64, 64, 4, 3), (128, 64, 8, 3))]
    for kind in args.kinds:
        for d in args.d:
            current = config_for(kind, d)
            chosen = (current.block_m, current.block_n, current.num_warps, current.num_stages)
            for shape in dict.fromkeys([chosen, *CANDIDATES[kind], *extra]):
                jobs.append((kind, d, shape, shape == chosen))
    rows = []
    for kind, d, shape, chosen in tqdm(jobs, desc="compiling for sm_90a"):
        try:
            row = resources(kind, d, shape)
        except Exception as e:  # a shape Triton cannot build (e.g. out of resources) is a row, not a crash
            row = {"pass": kind, "d": d, "block_m": shape[0], "block_n": shape[1], "num_warps": shape[2],
                   "num_stages": shape[3], "fits": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        row["current"] = chosen
        rows.append(row)
    lines = [f"Triton {triton.__version__}, sm_90a, bf16, one interval per column; `*` = current choice (`config_for`); "
             f"shared limit {SMEM_LIMIT // 1024} KiB.", "",
             "| pass | D | BLOCK_M x BLOCK_N, warps, stages | registers | spill stores B | shared KiB | fits |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['block_m']} x {r['block_n']}, {r['num_warps']}, {r['num_stages']}{' *' if r['current'] else ''}"
        if "error" in r:
            lines.append(f"| {r['pass']} | {r['d']} | {shape} | {r['error']} | | | no |")
        else:
            lines.append(f"| {r['pass']} | {r['d']} | {shape} | {r['registers']} | {r['spill_store_bytes']} | "
                         f"{r['shared_bytes'] / 1024:.0f} | {'yes' if r['fits'] else 'no'} |")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"triton": triton.__version__, "command": "python -m launch.bench.tune_triton "
                                         + " ".join(sys.argv[1:]), "rows": rows}, indent=1))


@contextlib.contextmanager
def candidate(tf, kind: str, d: int, shape: tuple[int, int, int, int]):
    """The launchers take ``shape`` for pass ``kind`` at head dim ``d`` (they call ``config_for`` each time)."""
    original = tf.config_for
    tf.config_for = lambda k, head_dim: tf.KernelConfig(*shape) if (k, head_dim) == (kind, d) else original(k, head_dim)
    try:
        yield
    finally:
        tf.config_for = original


def sweep(args) -> None:
    """Time every candidate of every pass on the GPU; print the best per (D, mask, pass), write the rows."""
    import torch
    from triton.testing import do_bench

    from fm_parallel.kernels.triton import backend as tf
    from launch.bench.kernel import build

    if not torch.cuda.is_available():
        raise SystemExit("error: the sweep times the kernels on a CUDA GPU; none here (--static compiles without one)")

    @functools.cache
    def static_of(kind, d, cand) -> dict:
        """Registers and spills of one shape (compile only; the same for every mask, so once per shape).
        A failure here only loses the spill filter."""
        try:
            static = resources(kind, d, cand)
            return {"spill_bytes": static["spill_store_bytes"], "registers": static["registers"]}
        except Exception as e:  # noqa: BLE001
            return {"static_error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}

    rows = []
    for d in args.d:
        for name in args.masks:
            torch.manual_seed(0)
            fm = build(name, args.n)[0].to("cuda")
            pairs = int(fm.visible_pairs().sum())
            q, k, v = (torch.randn(1, args.heads, args.n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            do = torch.randn_like(q)
            pos = torch.arange(args.n, device="cuda")
            scale = d**-0.5
            out, lse = tf.flashmask_fwd(q, k, v, fm, pos, scale, 0)
            delta = (out.float() * do.float()).sum(-1)  # the backward's preprocess, rowsum(dO * O)
            calls = {
                "fwd": lambda: tf.flashmask_fwd(q, k, v, fm, pos, scale, 0),
                "bwd_kv": lambda: tf.bwd_kv(q, k, v, do, lse, delta, fm, pos, scale, 0),
                "bwd_q": lambda: tf.bwd_q(q, k, v, do, lse, delta, fm, pos, scale, 0),
            }
            for kind in args.kinds:
                for cand in dict.fromkeys([*CANDIDATES[kind], *EXTRA.get(d, {}).get(kind, [])]):
                    row = {"d": d, "mask": name, "kind": kind, "config": cand}
                    row.update(static_of(kind, d, cand))
                    if row.get("spill_bytes", 0) > args.max_spill:
                        row["skipped"] = f"spills {row['spill_bytes']} B > --max-spill {args.max_spill}"
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    try:
                        with candidate(tf, kind, d, cand):
                            t0 = time.perf_counter()
                            calls[kind]()
                            torch.cuda.synchronize()
                            row["compile_s"] = time.perf_counter() - t0
                            lo, ms, hi = do_bench(calls[kind], warmup=10, rep=40, quantiles=[0.0, 0.5, 1.0])
                        row.update(ms=ms, ms_min=lo, ms_max=hi, tflops=2 * MATMULS[kind] * args.heads * d * pairs / ms / 1e9)
                    except Exception as e:  # e.g. a shape that needs more shared memory than the SM has
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    rows.append(row)
                    print(" ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
    print("\nbest per (d, mask, kind):")
    for key in sorted({(r["d"], r["mask"], r["kind"]) for r in rows}):
        ok = [r for r in rows if (r["d"], r["mask"], r["kind"]) == key and "ms" in r]
        if ok:
            best = max(ok, key=lambda r: r["tflops"])
            print(key, best["config"], f"{best['tflops']:.0f} TF/s (ms min / median / max "
                  f"{best['ms_min']:.3f} / {best['ms']:.3f} / {best['ms_max']:.3f})")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--static", action="store_true", help="compile for sm_90a and report registers / spills (no GPU)")
    parser.add_argument("--d", type=int, nargs="+", default=None, help="head dims (sweep: 128; --static: 64 128 256)")
    parser.add_argument("--kinds", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--n", type=int, default=16384, help="sweep: sequence length")
    parser.add_argument("--heads", type=int, default=16, help="sweep: query heads")
    parser.add_argument("--masks", nargs="+", default=["causal", "docs"], help="sweep: kernel.py's mask names")
    parser.add_argument("--max-spill", type=int, default=512,
                        help="sweep: skip shapes whose compiled kernel spills more bytes per thread than this")
    parser.add_argument("--tag", default="tune_triton", help="sweep: the JSON's name under --out")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--extra", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                        help="--static: more block shapes to compile for every pass and head dim")
    parser.add_argument("--json", type=Path, help="--static: write the rows here")
    args = parser.parse_args()
    try:
        args.extra = [tuple(int(x) for x in e.split(",")) for e in args.extra]
    except ValueError:
        args.extra = [()]
    if any(len(e) != 4 for e in args.extra):
        parser.error(f"--extra: expected BM,BN,WARPS,STAGES entries of 4 integers, got {' '.join(sys.argv[sys.argv.index('--extra') + 1:])}")
    args.d = args.d or ([64, 128, 256] if args.static else [128])
    static_report(args) if args.static else sweep(args)


if __name__ == "__main__":
    main()
