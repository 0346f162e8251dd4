"""Registers, spills and shared memory of the Triton kernels' block shapes on Hopper, without a GPU.

    python launch/bench/triton_static.py                       # every pass x D 64/128/256 x candidate
    python launch/bench/triton_static.py --d 256 --json docs/benchmarks/triton_static.json

Triton compiles for ``sm_90a`` on a machine without a GPU (``triton.compile`` with a ``GPUTarget``),
and the ``ptxas`` it ships reports each kernel's registers per thread and spilled bytes (``-v``).
A shape that spills, or whose shared memory passes the 227 KiB a Hopper block may use, will be slow
or will not launch: this prunes the GPU sweep of ``tune_triton.py`` (candidates from its table plus
the current ``_HOPPER`` choices, marked ``*``) before device time is spent. It measures no speed.
The local Triton may differ from the GPU image's (3.6): the report names the version it used.

Registers alone do not discriminate: ptxas fills the 255 a thread may have even for a plain
flash-attention forward (no mask, one loop), compiled here as the ``reference`` row. Spills do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch" / "bench"))

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

    from fm_parallel.kernels import triton_kernels as tk

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--kinds", nargs="+", default=["fwd", "bwd_kv", "bwd_q"])
    parser.add_argument("--extra", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                        help="more block shapes to compile for every pass and head dim")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    extra = [tuple(int(x) for x in e.split(",")) for e in args.extra]
    if any(len(e) != 4 for e in extra):
        raise ValueError(f"--extra: expected BM,BN,WARPS,STAGES entries, got {args.extra}")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter has no compiler to report on
    import json

    import triton
    from tqdm import tqdm
    from tune_triton import CANDIDATES

    from fm_parallel.kernels.triton_flashmask import _HOPPER

    jobs = [("reference", d, shape, False) for d in args.d for shape in ((64, 64, 4, 3), (128, 64, 8, 3))]
    for kind in args.kinds:
        for d in args.d:
            current = _HOPPER[kind][d]
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
    lines = [f"Triton {triton.__version__}, sm_90a, bf16, one interval per column; `*` = current `_HOPPER` choice; "
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
        args.json.write_text(json.dumps({"triton": triton.__version__, "command": "python launch/bench/triton_static.py "
                                         + " ".join(sys.argv[1:]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
