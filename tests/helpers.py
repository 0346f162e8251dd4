"""Shared test helpers: random inputs and masks, a tiny HF Llama, the trainer's tiny run, the
plain-PyTorch baseline and the derived tolerance. Test modules import these from here, never from
each other.

Tolerance rule (see ../shared/style.md): our error against the float64 reference must be within 2x
of the error that plain PyTorch (SDPA with a dense bool mask, in the same dtype) makes against the
same reference, plus a floor of a few ulps of the output's scale for float32/float64, where both
errors are at rounding level and their ratio is noise.
"""

import random

import torch
import torch.nn.functional as F

from fm_parallel import masks
from fm_parallel.masks import TileClass
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


def random_intervals(b, h, nq, nk, max_m, seed):
    """Random sorted, disjoint, non-adjacent intervals per column, and their dense picture."""
    rng = random.Random(seed)
    fms = torch.full((b, h, nk, max_m), nq, dtype=torch.int32)
    fme = torch.full((b, h, nk, max_m), -1, dtype=torch.int32)
    picture = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for j in range(nk):
                k = rng.randint(0, max_m)
                cuts = sorted(rng.sample(range(nq + 1), min(2 * k, nq + 1)))
                for m in range(len(cuts) // 2):
                    s, e = cuts[2 * m], cuts[2 * m + 1] - 1
                    if m and s <= int(fme[bi, hi, j, m - 1]) + 1:
                        continue  # touching the previous one: would merge, keep the test exact
                    if s > e:
                        continue
                    fms[bi, hi, j, m], fme[bi, hi, j, m] = s, e
                    picture[bi, hi, s : e + 1, j] = True
    return fms, fme, picture


def truth(dense: torch.Tensor, positions: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """Brute-force class of every tile of a [Nq, Nk] picture whose rows are at `positions`."""
    sub = dense[positions]
    nq, nk = sub.shape
    out = torch.empty(-(-nq // block_q), -(-nk // block_k), dtype=torch.int8)
    for i in range(out.shape[0]):
        for c in range(out.shape[1]):
            tile = sub[i * block_q : (i + 1) * block_q, c * block_k : (c + 1) * block_k]
            out[i, c] = TileClass.FULL if tile.all() else TileClass.SKIP if not tile.any() else TileClass.PARTIAL
    return out


def mask_families(n):
    return {
        "causal": masks.causal(n),
        "document": masks.document([20, 0, 31, 5], n=n),  # trailing padding: 21 rows see nothing
        "document_bidir": masks.document([30, 47], causal=False, n=n),
        "dpo": masks.dpo(30, 20, 17, n=n),
        "reward_model": masks.preference(20, [15, 20, 22]),
        "prefix_lm_docs": masks.prefix_lm(prefix_len=[10, 3], lengths=[40, 37]),
        "sliding_sinks": masks.sliding_window(n, 9, sinks=3),
        "union_multi": masks.union(masks.sliding_window(n, 5), masks.document([25, 25, 27], causal=False)),
        # Global rows 0..2 (see every key) + a window with sinks: tiles full through different interval
        # slots in different columns (the tile rule's cover slot makes them full).
        "global_window": masks.union(masks.sliding_window(n, 61, sinks=3),
                                     masks.FlashMask(torch.zeros(n, dtype=torch.int32), torch.full((n,), 2, dtype=torch.int32))),
    }


def tiny_llama(impl: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attn_implementation=impl)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).double()


# The trainer's tiny LoRA run on the CPU (launch/train.py flags).
TINY = ["--model.hidden_size", "64", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
        "--model.intermediate_size", "128", "--model.lora_rank", "4", "--data.seq_len", "128",
        "--training.steps", "2", "--training.warmup", "1", "--training.loss_chunk", "64", "--parallel.cp", "none",
        "--output.checkpoint_every", "1"]
