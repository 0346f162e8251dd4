"""GPU check of the Triton kernel where a tensor spans more than 2^31 elements (64-bit offsets).

    python -m pytest -q -rs tests/gpu/test_wide.py        # on the H200: 1M tokens, 32 query / 8 KV heads, D 128

Runs forward + backward on all heads at once (q spans 2^32 elements: the 64-bit path) and again on
four head groups of 8 query / 2 KV heads (each under 2^31: the 32-bit path), and asserts the outputs
and the three gradients agree. Was ``launch/bench/verify_wide.py`` (issue 32.3).
"""

import torch

from fm_parallel import flashmask_attention, masks
from tests.gpu import needs_cuda

N, HEADS, KV_HEADS, GROUPS, D = 1 << 20, 32, 8, 4, 128


@needs_cuda
def test_64_bit_offsets_agree_with_head_groups_under_2_to_the_31():
    torch.manual_seed(0)
    device = "cuda"
    mask = masks.document(masks.sample_lengths(N)).to(device)
    q = torch.randn(1, HEADS, N, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, N, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(1, KV_HEADS, N, D, device=device, dtype=torch.bfloat16)
    dout = torch.randn(1, HEADS, N, D, device=device, dtype=torch.bfloat16)
    assert q.numel() > 2**31  # the whole call takes the 64-bit path

    def fwd_bwd(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flashmask_attention(q, k, v, mask=mask, impl="triton")
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    whole = fwd_bwd(q, k, v, dout)
    gq, gk = HEADS // GROUPS, KV_HEADS // GROUPS
    parts = [fwd_bwd(q[:, i * gq:(i + 1) * gq], k[:, i * gk:(i + 1) * gk], v[:, i * gk:(i + 1) * gk],
                     dout[:, i * gq:(i + 1) * gq]) for i in range(GROUPS)]
    bad = {}
    for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        split = torch.cat([p[index] for p in parts], dim=1)
        err = (whole[index].float() - split.float()).abs().max().item()
        scale = split.float().abs().max().item()
        if not (err <= 1e-2 * max(scale, 1e-6) and torch.isfinite(whole[index]).all().item()):
            bad[name] = f"max |whole - per group| = {err:.3g} (max |value| {scale:.3g})"
    assert not bad, bad
