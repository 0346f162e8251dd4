"""The custom-op wiring every GPU backend shares (fm_parallel/kernels/custom_op.py), driven here by the PyTorch
launchers so it runs on the CPU: schema and fake implementation (torch.library.opcheck), gradients
of the output and of the lse against the float64 reference, and how the op finds the caller's mask
object again (its caches, what it knows of its structure) from tensors alone."""

import torch

from fm_parallel import backends, masks
from fm_parallel.kernels import custom_op
from fm_parallel.reference import reference_attention
from tests.helpers import assert_matches_reference, qkv


def _fwd(q, k, v, mask, positions, scale, q_offset):
    SEEN.append(mask)
    return backends.get("torch").forward(q, k, v, mask, positions, scale)


def _bwd(q, k, v, out, lse, dout, mask, positions, scale, dlse, q_offset, deterministic):
    SEEN.append(mask)
    return backends.get("torch").backward(q, k, v, out, lse, dout, mask, positions, scale, dlse)


SEEN: list = []  # the mask objects the launchers received
attention = custom_op.define_attention_op("test_blockwise", _fwd, _bwd)


def test_output_and_gradients_match_the_reference_through_the_op():
    q, k, v = qkv(1, 4, 2, 70, 16, torch.float32, seed=5)
    m = masks.dpo(30, 20, 20)
    rows = torch.arange(70)
    assert_matches_reference(lambda: attention(q, k, v, m, rows, 0.25, 0)[0].to(q.dtype), q, k, v, m)


def test_lse_gradient_flows_through_the_op():
    """The ring merge differentiates the lse: its gradient must reach q and k through the op."""
    q, k, v = qkv(1, 2, 1, 40, 8, torch.float64, seed=2)
    m = masks.sliding_window(40, 7, sinks=2)
    rows = torch.arange(10, 40)
    q = q[:, :, 10:].detach().requires_grad_()
    weights = torch.randn(1, 2, 30, dtype=torch.float64)
    _, lse = attention(q, k, v, m, rows, 0.3, 10)
    got = torch.autograd.grad((lse * weights).sum(), (q, k))
    q64, k64 = (t.detach().requires_grad_() for t in (q, k))
    _, ref_lse = reference_attention(q64, k64, v.detach(), m, scale=0.3, q_positions=rows)
    want = torch.autograd.grad((ref_lse * weights).sum(), (q64, k64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_opcheck_schema_fake_and_autograd_registration():
    q, k, v = qkv(1, 2, 1, 24, 8, torch.float32, seed=3)
    m = masks.document([10, 14])
    op = torch.ops.fm_parallel.test_blockwise_fwd.default
    torch.library.opcheck(op, (q, k, v, m.fms, m.fme, torch.arange(24), 24, 0.3, 0, True))


def test_the_op_finds_the_live_mask_that_owns_the_bounds_and_nothing_else():
    m = masks.causal(16)
    assert custom_op.known_mask(m.fms, m.fme, 16) is m  # its launch-metadata cache and structure survive
    assert custom_op.known_mask(m.fms.clone(), m.fme, 16) is not m  # equal data, other tensor: a new mask
    assert custom_op.known_mask(m.fms, m.fme, 17) is not m
    fms, fme = m.fms, m.fme
    del m
    import gc

    gc.collect()
    fresh = custom_op.known_mask(fms, fme, 16)  # the owner is gone: nothing stale, nothing kept alive
    assert fresh.fms is fms and fresh.causal_documents() == (16,)


def test_cached_data_is_recomputed_after_an_in_place_edit_of_the_bounds():
    m = masks.causal(16)
    calls = []
    assert m.cached("x", lambda: calls.append(1) or len(calls)) == 1
    assert m.cached("x", lambda: calls.append(1) or len(calls)) == 1
    m.fme.add_(0)  # an in-place edit bumps the version counter
    assert m.cached("x", lambda: calls.append(1) or len(calls)) == 2


def test_under_torch_compile_the_launchers_get_the_callers_mask_with_what_it_knows():
    """The op takes tensors only; the launchers must still get the caller's FlashMask object (its plan
    caches, and its document structure, which decides FA4's causal / varlen path under impl='cute')."""
    q, k, v = qkv(1, 2, 1, 24, 8, torch.float32, seed=4)
    m = masks.document([10, 14])  # built on the CPU: knows it is packed causal documents
    rows = torch.arange(24)
    SEEN.clear()
    compiled = torch.compile(lambda q_, k_, v_: attention(q_, k_, v_, m, rows, 0.3, 0)[0], backend="aot_eager",
                             fullgraph=True)
    q.requires_grad_()
    compiled(q, k, v).sum().backward()
    assert SEEN and all(s is m for s in SEEN), SEEN
    assert SEEN[0].causal_documents() == (10, 14)


def test_eager_path_and_the_op_give_the_same_outputs_and_gradients():
    """Eager calls skip the dispatcher (an autograd.Function around the same launchers); torch.compile
    traces the op. Both must agree to the bit, lse gradient included."""
    q, k, v = qkv(1, 2, 1, 40, 8, torch.float64, seed=7)
    m = masks.document([15, 25])
    rows = torch.arange(40)
    weights = torch.randn(1, 2, 40, dtype=torch.float64)
    results = []
    for call in (lambda *a: attention(*a),
                 lambda q_, k_, v_, m_, r, s, o: torch.ops.fm_parallel.test_blockwise_fwd(q_, k_, v_, m_.fms, m_.fme, r,
                                                                                          m_.num_rows, s, o, True)):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = call(qq, kk, vv, m, rows, 0.3, 0)
        (out.sum() + (lse * weights).sum()).backward()
        results.append((out, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
