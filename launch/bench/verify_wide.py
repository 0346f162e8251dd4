"""GPU check of the Triton kernel where a tensor spans more than 2^31 elements (64-bit offsets).

    python launch/bench/verify_wide.py            # on the H200: 1M tokens, 32 query / 8 KV heads, D 128

Runs forward + backward on all heads at once (q spans 2^32 elements: the 64-bit path) and again on
four head groups of 8 query / 2 KV heads (each under 2^31: the 32-bit path), and asserts the outputs
and the three gradients agree. Prints PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1 << 20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    from fm_parallel import flashmask_attention, masks

    torch.manual_seed(0)
    n, hq, hkv, d = args.n, args.heads, args.kv_heads, 128
    mask = masks.document(masks.sample_lengths(n)).to(args.device)
    q = torch.randn(1, hq, n, d, device=args.device, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device=args.device, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, d, device=args.device, dtype=torch.bfloat16)
    dout = torch.randn(1, hq, n, d, device=args.device, dtype=torch.bfloat16)

    def fwd_bwd(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flashmask_attention(q, k, v, mask=mask, impl="triton")
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    whole = fwd_bwd(q, k, v, dout)
    gq, gk = hq // args.groups, hkv // args.groups
    parts = [fwd_bwd(q[:, i * gq:(i + 1) * gq], k[:, i * gk:(i + 1) * gk], v[:, i * gk:(i + 1) * gk], dout[:, i * gq:(i + 1) * gq])
             for i in range(args.groups)]
    ok = True
    for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        split = torch.cat([p[index] for p in parts], dim=1)
        err = (whole[index].float() - split.float()).abs().max().item()
        scale = split.float().abs().max().item()
        good = err <= 1e-2 * max(scale, 1e-6) and torch.isfinite(whole[index]).all().item()
        ok &= good
        print(f"{name}: max |whole - per group| = {err:.3g} (max |value| {scale:.3g}) {'ok' if good else 'MISMATCH'}")
    print(f"{'PASS' if ok else 'FAIL'}: N={n} Hq={hq} Hkv={hkv} D={d} (q spans {q.numel()} elements)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
