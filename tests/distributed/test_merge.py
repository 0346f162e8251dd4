"""The log-sum-exp merge (the ring's, and the public ``merge``) against attention over all keys."""

import torch

from fm_parallel.distributed import merge
from fm_parallel.distributed.merge import merge_into


def _part(q, k, v, visible):
    """Softmax attention over the visible keys only: (out, lse), 0 / -inf for rows that see none."""
    s = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def test_merge_of_two_key_sets_equals_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    visible = torch.rand(1, 2, 12, 12, generator=g) < 0.5
    visible[..., 3, :] = False  # a row that sees no key in either part
    half = torch.zeros(12, dtype=torch.bool)
    half[:6] = True
    a, b = _part(q, k, v, visible & half), _part(q, k, v, visible & ~half)
    want_out, want_lse = _part(q, k, v, visible)
    out, lse = merge(*a, *b)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse)
    assert (out[..., 3, :] == 0).all() and torch.isinf(lse[..., 3]).all()
    # Into a view of a running output (a row window), the first part overwritten in place.
    run_out, run_lse = a[0].clone(), a[1].clone()
    merge_into(run_out[:, :, 2:9], run_lse[:, :, 2:9], run_out[:, :, 2:9], run_lse[:, :, 2:9], b[0][:, :, 2:9], b[1][:, :, 2:9])
    assert torch.allclose(run_out[:, :, 2:9], want_out[:, :, 2:9], atol=1e-12)
    assert torch.equal(run_out[:, :, :2], a[0][:, :, :2])  # rows outside the window untouched


def test_merge_weighs_low_precision_parts_in_the_lse_precision_and_rounds_once():
    g = torch.Generator().manual_seed(1)
    out_a, out_b = (torch.randn(1, 2, 16, 8, generator=g).bfloat16() for _ in range(2))
    lse_a, lse_b = (torch.randn(1, 2, 16, generator=g) for _ in range(2))
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    exact, _ = merge(out_a.float(), lse_a, out_b.float(), lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, exact.bfloat16())
