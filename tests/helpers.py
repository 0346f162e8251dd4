"""Shared test helpers: random inputs, the plain-PyTorch baseline and the derived tolerance.

Tolerance rule (see ../shared/style.md): our error against the float64 reference must be within 2x
of the error that plain PyTorch (SDPA with a dense bool mask, in the same dtype) makes against the
same reference, plus a floor of a few ulps of the output's scale for float32/float64, where both
errors are at rounding level and their ratio is noise.
"""

import torch
import torch.nn.functional as F

from fm_parallel.reference import reference_attention

FLOOR_ULPS = 16


def qkv(b, hq, hkv, n, d, dtype, seed=0, nk=None, dv=None):
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    q = torch.randn(b, hq, n, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, nk, dv or d, generator=g).to(dtype).requires_grad_()
    return q, k, v


def plain_sdpa(q, k, v, mask, positions=None):
    """SDPA in q's dtype with the dense bool mask; rows that see nothing are zeroed (SDPA gives NaN)."""
    rows = torch.arange(q.shape[2], device=q.device) if positions is None else positions
    dense = mask.to_dense(rows=rows)  # [Bm, Hm, Nq, Nk]
    hq, hkv = q.shape[1], k.shape[1]
    if dense.shape[1] == hkv and hkv != hq:
        dense = dense.repeat_interleave(hq // hkv, dim=1)
    has_any = dense.any(-1, keepdim=True)
    rep = hq // hkv
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dense | ~has_any
    )
    return out * has_any


def grads(fn, inputs, dout):
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(dout)
    g = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach(), g


def assert_matches_reference(fn, q, k, v, mask, positions=None, seed=1):
    """Compare fn() (output and q/k/v gradients) with the float64 reference, tolerance derived as above."""
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g).to(q.device, q.dtype)
    inputs = (q, k, v)
    ours, ours_g = grads(fn, inputs, dout)
    base, base_g = grads(lambda: plain_sdpa(q, k, v, mask, positions), inputs, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in inputs)
    ref, ref_g = grads(lambda: reference_attention(q64, k64, v64, mask, q_positions=positions)[0], (q64, k64, v64), dout.double())
    eps = torch.finfo(q.dtype).eps
    for name, a, b, r in zip(["out", "dq", "dk", "dv"], [ours] + ours_g, [base] + base_g, [ref] + ref_g):
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = (a.double() - r).abs().max().item()
        base_err = (b.double() - r).abs().max().item()
        floor = FLOOR_ULPS * eps * max(r.abs().max().item(), 1.0) if q.dtype in (torch.float32, torch.float64) else 0.0
        assert err <= 2 * base_err + floor, f"{name}: error {err:.3g} > 2 x plain PyTorch {base_err:.3g} + {floor:.3g}"


def tiny_lora_llama(*argv: str, layers: int, dtype: str = "float64"):
    """The trainer's own model on the CPU: a Llama 32 wide (4 query / 2 KV heads, MLP 64, vocabulary
    258) with LoRA r4, plus the trainer keys in ``argv``. LoRA's B weights start at zero, which would
    hide the adapter from a gradient comparison: they are drawn at random (the same within a process)."""
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.model import build_model

    base = ["--model.hidden_size", "32", "--model.layers", str(layers), "--model.heads", "4", "--model.kv_heads", "2",
            "--model.intermediate_size", "64", "--model.dtype", dtype, "--parallel.cp", "none", "--model.lora_rank", "4"]
    model = build_model(load_config([*base, *argv], environ={}), 258, torch.device("cpu"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return model


def track_returns(monkeypatch, owner, name: str) -> list:
    """Replace ``owner.name`` (a function of a module or object) by one that records every value it
    returns by weak reference: ``made[-1]() is None`` once the latest is freed. Returns ``made``, the
    list it fills."""
    import weakref

    made = []
    real = getattr(owner, name)

    def tracked(*args, **kwargs):
        out = real(*args, **kwargs)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(owner, name, tracked)
    return made


def track_final_hidden_states(monkeypatch) -> list:
    """:func:`track_returns` of ``fm_parallel.trainer.model.hidden``: the decoder's final hidden state,
    what the loss reads."""
    import fm_parallel.trainer.model as trainer_model

    return track_returns(monkeypatch, trainer_model, "hidden")
