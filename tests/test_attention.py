"""flashmask_attention as a public function: mask sources, impl choice, fallback, bad input."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from fm_parallel import FlashMask, flashmask_attention, masks
from fm_parallel.reference import reference_attention
from tests.helpers import qkv


def test_drop_in_for_sdpa_with_dense_mask(caplog):
    q, k, v = qkv(2, 4, 4, 96, 16, torch.float32)
    m = masks.document([30, 30, 36])
    dense = m.to_dense()
    with caplog.at_level(logging.WARNING, logger="fm_parallel"):
        ours = flashmask_attention(q, k, v, attn_mask=dense[0, 0])
    assert not caplog.records  # expressible: no fallback
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=2e-6, rtol=1e-5)
    raw = flashmask_attention(q, k, v, m.fms[..., 0].long(), m.fme[..., 0].long())  # int64 bounds, 3-D
    torch.testing.assert_close(raw, ours, atol=0, rtol=0)


def test_is_causal_and_unmasked_match_sdpa():
    q, k, v = qkv(1, 2, 2, 70, 8, torch.float32)
    torch.testing.assert_close(
        flashmask_attention(q, k, v, is_causal=True, block_size=16),
        F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=2e-6, rtol=1e-5,
    )
    torch.testing.assert_close(
        flashmask_attention(q, k, v, block_size=16), F.scaled_dot_product_attention(q, k, v), atol=2e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        flashmask_attention(q, k, v, scale=0.3), F.scaled_dot_product_attention(q, k, v, scale=0.3), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("nq, nk", [(70, 33), (33, 70), (1, 5), (9, 1)])
@pytest.mark.parametrize("impl", ["torch", "dense", "triton"])
def test_is_causal_with_unequal_lengths_aligns_top_left_like_sdpa(nq, nk, impl):
    """SDPA's is_causal puts row i against keys j <= i (top-left) whatever the lengths: a drop-in must too,
    forward and backward (rows past the last key see every key). Triton in bf16 on a GPU: within 2x of
    SDPA's own bf16 error against float64."""
    if impl == "triton" and not torch.cuda.is_available():
        pytest.skip("the Triton path of the public function needs CUDA (interpreter tests: tests/kernels)")
    device = "cuda" if impl == "triton" else "cpu"
    dtype = torch.bfloat16 if impl == "triton" else torch.float64
    torch.manual_seed(0)
    q64 = torch.randn(1, 2, nq, 64, dtype=torch.float64, device=device)
    k64, v64 = (torch.randn(1, 2, nk, 64, dtype=torch.float64, device=device) for _ in range(2))
    exact = [t.requires_grad_() for t in (q64.clone(), k64.clone(), v64.clone())]
    want = F.scaled_dot_product_attention(*exact, is_causal=True)
    want_grads = torch.autograd.grad(want.sum(), exact)
    runs = {}
    for name, fn in (("ours", lambda *t: flashmask_attention(*t, is_causal=True, impl=impl)),
                     ("sdpa", lambda *t: F.scaled_dot_product_attention(*t, is_causal=True))):
        inputs = [t.detach().to(dtype).requires_grad_() for t in exact]
        out = fn(*inputs)
        runs[name] = [out, *torch.autograd.grad(out.float().sum(), inputs)]
    for i, ref in enumerate([want, *want_grads]):
        err = ((runs["ours"][i].double() - ref).norm() / ref.norm().clamp(min=1.0)).item()
        base = ((runs["sdpa"][i].double() - ref).norm() / ref.norm().clamp(min=1.0)).item()
        assert err <= 2 * base + 1e-9, (i, err, base)


def test_inexpressible_mask_falls_back_to_dense_and_logs_once(caplog):
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(64, 64, generator=g) < 0.5  # random dropout-like mask: many intervals per column
    dense[:, 0] = True
    q, k, v = qkv(1, 2, 2, 64, 8, torch.float64)
    with caplog.at_level(logging.WARNING, logger="fm_parallel"):
        out = flashmask_attention(q, k, v, attn_mask=dense)
        out.sum().backward()
        flashmask_attention(q, k, v, attn_mask=dense)
    fallbacks = [r for r in caplog.records if "chunked dense attention" in r.getMessage()]
    assert len(fallbacks) == 1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.isfinite(q.grad).all()


def test_additive_bias_falls_back():
    q, k, v = qkv(1, 1, 1, 20, 8, torch.float32)
    bias = torch.randn(20, 20)
    out = flashmask_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), atol=2e-6, rtol=1e-5)


def test_per_head_dense_mask():
    q, k, v = qkv(2, 4, 2, 40, 8, torch.float64)
    fms_a = masks.stack([masks.causal(40), masks.sliding_window(40, 5)])
    dense = fms_a.to_dense().expand(2, 2, 40, 40).clone()
    dense[:, 1] = masks.document([10, 30]).to_dense()[0, 0]
    out = flashmask_attention(q, k, v, attn_mask=dense)
    m = masks.from_dense(dense)
    ref, _ = reference_attention(q, k, v, m)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_explicit_impl_is_honoured_or_raises(monkeypatch):
    q, k, v = qkv(1, 1, 1, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="impl: 'cute' needs CUDA tensors, got device cpu"):
        flashmask_attention(q, k, v, impl="cute")
    with pytest.raises(ValueError, match="deterministic: impl='cute' has no reproducible backward"):
        flashmask_attention(q, k, v, impl="cute", deterministic=True)
    with pytest.raises(ValueError, match=r"deterministic: expected a bool \(True or False\), got 'yes'"):
        flashmask_attention(q, k, v, deterministic="yes")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # outside the interpreter Triton needs a GPU
    with pytest.raises(ValueError, match="impl: 'triton' needs CUDA tensors, got device cpu"):
        flashmask_attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'cute', 'triton', 'torch', 'dense'\), got 'fast'"):
        flashmask_attention(q, k, v, impl="fast")
    a = flashmask_attention(q, k, v, impl="dense", is_causal=True)
    b = flashmask_attention(q, k, v, impl="torch", is_causal=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _stand_ins(monkeypatch, loaded: dict, missing=()):
    """Backends replaced by stand-in modules (no GPU here); ``missing``: names whose module cannot import."""
    from fm_parallel import backends

    monkeypatch.setattr(backends, "_LOADED", dict(loaded))
    monkeypatch.setattr(backends, "_logged", set())
    for name in missing:
        b = backends.get(name)
        monkeypatch.setitem(backends._REGISTRY, name, dataclasses.replace(b, module="fm_parallel_no_such_module"))
    return backends


def test_auto_on_cuda_prefers_a_cute_backend_that_supports_the_device(monkeypatch):
    """The choice only (no GPU here): backends are stand-ins; ``torch.device("cuda")`` needs no GPU."""
    import types

    cuda = torch.device("cuda")
    hopper = types.SimpleNamespace(supports=lambda device: True)
    other_gpu = types.SimpleNamespace(supports=lambda device: False)
    triton = types.SimpleNamespace()
    backends = _stand_ins(monkeypatch, {"cute": hopper, "triton": triton})
    assert backends.AUTO_ORDER_CUDA == ("cute", "triton")  # cute passed verify_gpu.py on the H200
    assert backends.resolve("auto", cuda) == backends.resolve(None, cuda) == "cute"
    # A reproducible backward required: auto skips the atomics-based backend, an explicit cute is refused.
    assert backends.resolve("auto", cuda, deterministic=True) == "triton"
    with pytest.raises(ValueError, match="deterministic: impl='cute' has no reproducible backward"):
        backends.resolve("cute", cuda, deterministic=True)
    backends = _stand_ins(monkeypatch, {"cute": other_gpu, "triton": triton})
    assert backends.resolve("auto", cuda) == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    with pytest.raises(ValueError, match="impl: 'cute' does not run on NVIDIA A100 .*needs a Hopper GPU"):
        backends.resolve("cute", cuda)
    backends = _stand_ins(monkeypatch, {"triton": triton}, missing=["cute"])  # the [cute] extra missing
    assert backends.resolve("auto", cuda) == "triton"
    with pytest.raises(ValueError, match="impl: 'cute' is not available here"):
        backends.resolve("cute", cuda)


def test_auto_skips_a_backend_that_cannot_take_the_dtype_or_head_dim_and_an_explicit_one_says_why(monkeypatch):
    import types

    cuda = torch.device("cuda")
    hopper = types.SimpleNamespace(supports=lambda device: True, unsupported_inputs=lambda dt, d, dv: None if dt == torch.bfloat16 and d <= 256 else f"no {dt} {d}")
    backends = _stand_ins(monkeypatch, {"cute": hopper, "triton": types.SimpleNamespace()})
    assert backends.resolve("auto", cuda, torch.bfloat16, 128, 128) == "cute"
    assert backends.resolve("auto", cuda, torch.float32, 128, 128) == "triton"
    assert backends.resolve("auto", cuda, torch.bfloat16, 512, 512) == "triton"
    with pytest.raises(ValueError, match="no torch.float32 128"):
        backends.resolve("cute", cuda, torch.float32, 128, 128)


def test_resolve_refuses_unknown_names_and_dense_per_ring_chunk():
    from fm_parallel import backends

    cpu = torch.device("cpu")
    for bad in ("fast", "Triton", "", 3, ("torch",)):
        with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'cute', 'triton', 'torch', 'dense'\)"):
            backends.resolve(bad, cpu)
    assert backends.resolve("dense", cpu) == "dense"
    with pytest.raises(ValueError, match="impl: 'dense' runs only where the whole mask is local"):
        backends.resolve("dense", cpu, chunked=True)
    assert backends.resolve("auto", cpu, chunked=True) == "torch"


def test_auto_says_once_when_an_installed_backend_does_not_load(monkeypatch, caplog):
    """FA4 installed but missing a library of its own made auto fall back to Triton silently on the H200:
    not installed is skipped quietly (by design), installed-but-broken is logged once."""
    import importlib.util
    import types

    cuda = torch.device("cuda")
    real_find_spec = importlib.util.find_spec
    for installed in (False, True):
        backends = _stand_ins(monkeypatch, {"triton": types.SimpleNamespace()}, missing=["cute"])
        monkeypatch.setattr(importlib.util, "find_spec",  # flash-attn-4 present or not, whatever this machine has
                            lambda name, *a, _i=installed: (object() if _i else None) if name == "flash_attn" else real_find_spec(name, *a))
        caplog.clear()
        with caplog.at_level("WARNING", logger="fm_parallel"):
            assert backends.resolve("auto", cuda) == "triton"
            assert backends.resolve("auto", cuda) == "triton"
        said = [r.message for r in caplog.records if "skips 'cute'" in r.message]
        assert len(said) == (1 if installed else 0), said


def _bad_inputs():
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    k2, v2 = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    m = masks.causal(16)
    return [
        ("q 3-D", lambda: flashmask_attention(q[0], k, v), r"q: expected 4 dims \[B, H, N, D\]"),
        ("int q", lambda: flashmask_attention(q.long(), k, v), "q: expected one of float16"),
        ("dtype mix", lambda: flashmask_attention(q, k.double(), v), r"k: expected the dtype of q \(torch.float32\)"),
        ("heads", lambda: flashmask_attention(q, torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8)), "k: expected a number of heads dividing q's 4"),
        ("v length", lambda: flashmask_attention(q, k, v[:, :, :8]), r"v: expected heads and length \(4, 16\)"),
        ("head dim", lambda: flashmask_attention(q, k[..., :4], v), "k: expected head dim 8 like q, got 4"),
        ("mask keys", lambda: flashmask_attention(q, k, v, mask=masks.causal(15)), "mask: expected 16 key columns"),
        ("mask heads", lambda: flashmask_attention(q, k2, v2, mask=FlashMask(torch.zeros(1, 3, 16, dtype=torch.int32), torch.full((1, 3, 16), 15))), "mask: expected 1, H_kv=2 or H_q=4 heads, got 3"),
        ("mask batch", lambda: flashmask_attention(q, k, v, mask=masks.stack([m, m, m])), "mask: expected batch 1 or 1, got 3"),
        ("rows", lambda: flashmask_attention(q, k, v, mask=m, q_offset=4), "expected query rows < the mask's num_rows 16, got row 19"),
        ("offset", lambda: flashmask_attention(q, k, v, mask=m, q_offset=-1), "q_offset: expected an int >= 0, got -1"),
        ("positions", lambda: flashmask_attention(q, k, v, mask=m, q_positions=torch.arange(8)), r"q_positions: expected shape \[16\]"),
        ("fms only", lambda: flashmask_attention(q, k, v, m.fms), "fms, fme: expected both or neither, got only fms"),
        ("two masks", lambda: flashmask_attention(q, k, v, mask=m, is_causal=True), "expected at most one of"),
        ("dense shape", lambda: flashmask_attention(q, k, v, attn_mask=torch.ones(16, 15, dtype=torch.bool)), r"attn_mask: expected \[16, 16\]"),
        ("dense int", lambda: flashmask_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.int64)), "attn_mask: expected bool"),
        ("bad fms", lambda: flashmask_attention(q, k, v, torch.zeros(16, dtype=torch.int32), torch.full((16,), 16)), "fme: expected rows < num_rows = 16"),
        ("device", lambda: flashmask_attention(q, k, v, mask=m.to("meta")), "mask: expected device cpu like q, got meta"),
        ("scale", lambda: flashmask_attention(q, k, v, scale=float("nan")), "scale: expected a finite float"),
        ("block", lambda: flashmask_attention(q, k, v, block_size=0), "block_size: expected an int >= 1, got 0"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_value_error(case):
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()


def _misnamed_arguments():
    """Issue 35.4: arguments whose errors named another argument (num_rows, fms, 'prompt and
    responses'), lost it (union, stack), or were not ValueErrors at all; and their siblings that
    were silently accepted (bools and strings as flags or sizes)."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    checker = (torch.arange(10).view(10, 1) + torch.arange(10).view(1, 10)) % 2 == 0  # 5 ranges per column
    two_heads = FlashMask(torch.zeros(1, 2, 4, dtype=torch.int32), torch.full((1, 2, 4), 3))
    last = 2**31 - 1
    return [
        ("q_offset past int32", lambda: flashmask_attention(q, k, v, q_offset=2**31 - 8),
         r"q_offset: expected q_offset \+ Nq - 1 <= 2147483646 .*got q_offset=2147483640 with Nq=8"),
        ("q_offset past int32, mask", lambda: flashmask_attention(q, k, v, mask=masks.causal(8), q_offset=2**31 - 8),
         r"q_offset: expected q_offset \+ Nq - 1 <= 2147483646"),
        ("q_offset fms", lambda: flashmask_attention(q, k, v, masks.causal(8).fms, masks.causal(8).fme, q_offset=2**31 - 8),
         r"q_offset: expected q_offset \+ Nq - 1 <= 2147483646"),
        ("q_positions past int32", lambda: flashmask_attention(q, k, v, q_positions=torch.tensor([0, 1, 2, 3, 4, 5, 6, last])),
         r"q_positions: expected rows in \[0, 2147483646\].*got \[0, 2147483647\]"),
        ("q_positions bool", lambda: flashmask_attention(q, k, v, q_positions=torch.ones(8, dtype=torch.bool)),
         r"q_positions: expected an integer tensor \[8\], got torch.bool"),
        ("return_lse str", lambda: flashmask_attention(q, k, v, return_lse="y"), r"return_lse: expected a bool \(True or False\), got 'y'"),
        ("is_causal str", lambda: flashmask_attention(q, k, v, is_causal="x"), r"is_causal: expected a bool \(True or False\), got 'x'"),
        ("deterministic int", lambda: flashmask_attention(q, k, v, deterministic=1), r"deterministic: expected a bool \(True or False\), got 1"),
        ("scale bool", lambda: flashmask_attention(q, k, v, scale=True), "scale: expected a finite float, got True"),
        ("block_size bool", lambda: flashmask_attention(q, k, v, block_size=True), "block_size: expected an int >= 1, got True"),
        ("dpo zeros", lambda: masks.dpo(0, 0, 0), "prompt_len, chosen_len, rejected_len: expected at least one non-zero length .*got 0, 0, 0"),
        ("dpo packed zeros", lambda: masks.dpo([0], [0], [0]), r"prompt_len, chosen_len, rejected_len: .*got \[0\], \[0\], \[0\]"),
        ("preference zeros", lambda: masks.preference(0, [0, 0]), r"prompt_len, response_lens: expected at least one non-zero length .*got prompt_len=0, response_lens=\[0, 0\]"),
        ("union max_intervals bool", lambda: masks.union(masks.causal(4), masks.causal(4), max_intervals=True), r"max_intervals: expected an int in \[1, 4\], got True"),
        ("union which mask", lambda: masks.union(masks.causal(4), masks.causal(4), masks.causal(5)),
         r"masks\[2\]: expected num_keys=4, num_rows=4, device=cpu like masks\[0\] for union, got num_keys=5, num_rows=5"),
        ("intersect not a mask", lambda: masks.intersect(masks.causal(4), 3), r"masks\[1\]: expected a FlashMask for intersect, got int"),
        ("union none", lambda: masks.union(), "masks: expected at least one FlashMask for union, got none"),
        ("stack int", lambda: masks.stack(5), r"masks: expected a sequence of FlashMask \(one per batch row\), got int"),
        ("stack one mask", lambda: masks.stack(masks.causal(4)), "masks: expected a sequence of FlashMask .*got FlashMask"),
        ("stack heads", lambda: masks.stack([masks.causal(4), two_heads]), r"masks\[1\]: expected 1 mask heads like masks\[0\] for stack, got 2"),
        ("from_dense max_intervals 5", lambda: masks.from_dense(checker, max_intervals=5), r"max_intervals: expected an int in \[1, 4\], got 5"),
        ("sample_lengths float seed", lambda: masks.sample_lengths(100, 8, seed=1.5), r"seed: expected an int in \[-9223372036854775808, 18446744073709551615\], got 1.5"),
        ("bool tensor size", lambda: masks.causal(torch.tensor(True)), r"n: expected an int >= 1, got tensor\(True\)"),
        ("bool tensor sinks", lambda: masks.sliding_window(8, 2, sinks=torch.tensor(True)), r"sinks: expected an int >= 0, got tensor\(True\)"),
        ("bool tensor prefix", lambda: masks.prefix_lm(4, torch.tensor(True)), r"prefix_len: expected an int >= 0, got tensor\(True\)"),
        ("bool tensor lengths", lambda: masks.document(torch.tensor([True, True])), r"lengths: expected a 1-D integer tensor, got shape \(2,\) torch.bool"),
        ("bool doc_ids", lambda: masks.document(doc_ids=torch.tensor([True, True, False])), r"doc_ids: expected a non-empty \[N\] or \[B, N\] integer tensor, got \(3,\) torch.bool"),
        ("flex q_heads 0", lambda: masks.to_flex_mask_mod(two_heads, q_heads=0), "q_heads: expected an int >= 1, got 0"),
        ("flex block_size bool", lambda: masks.to_block_mask(masks.causal(4), block_size=True), "block_size: expected an int >= 1, got True"),
        ("document causal str", lambda: masks.document([2, 2], causal="x"), r"causal: expected a bool \(True or False\), got 'x'"),
    ]


@pytest.mark.parametrize("case", _misnamed_arguments(), ids=lambda c: c[0])
def test_errors_name_the_argument_the_caller_passed(case):
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()
