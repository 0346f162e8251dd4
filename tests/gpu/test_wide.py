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
    names = ("out", "dq", "dk", "dv")
    err, scale, finite = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, True)
    # One group at a time and one head at a time in float32 (512 MiB), so that the check fits an 80 GB
    # H100 next to the whole call's tensors: concatenating the groups and converting them whole took
    # 16 GiB more and ran out of memory there.
    for i in range(GROUPS):
        qs, ks = slice(i * gq, (i + 1) * gq), slice(i * gk, (i + 1) * gk)
        part = fwd_bwd(q[:, qs], k[:, ks], v[:, ks], dout[:, qs])
        for name, got, heads, split in zip(names, whole, (qs, qs, ks, ks), part):
            for head in range(split.shape[1]):
                a, b = got[:, heads][:, head].float(), split[:, head].float()
                err[name] = max(err[name], (a - b).abs().max().item())  # a NaN is caught by `finite`
                scale[name] = max(scale[name], b.abs().max().item())
                finite[name] = finite[name] and torch.isfinite(a).all().item() and torch.isfinite(b).all().item()
        del part
    bad = {name: f"max |whole - per group| = {err[name]:.3g} (max |value| {scale[name]:.3g}, finite: {finite[name]})"
           for name in names if not (err[name] <= 1e-2 * max(scale[name], 1e-6) and finite[name])}
    assert not bad, bad
