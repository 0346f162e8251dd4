"""The Hugging Face attention backend: equal to SDPA where both apply, FlashMasks through kwargs,
padding, peft LoRA, and context parallelism (ring, Ulysses, hybrid) against one process."""

import pytest
import torch

from tests.helpers import tiny_llama

from tests.distributed.spawn import run_cases

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_matches_sdpa_causal_documents_and_padding():
    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf

    name = fm_hf.register()
    assert fm_hf.register() == name  # idempotent
    ref, ours = tiny_llama("sdpa").eval(), tiny_llama(name).eval()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-12)
    # Packed documents through a FlashMask keyword: equal to running each document on its own.
    got = ours(ids[:1], flashmask=masks.document([15, 25])).logits
    pos = torch.arange(40).view(1, -1)
    want = torch.cat([ref(ids[:1, :15], position_ids=pos[:, :15]).logits, ref(ids[:1, 15:], position_ids=pos[:, 15:]).logits], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # Padding from a 2-D attention_mask, folded into the FlashMask.
    pad = torch.ones(2, 40, dtype=torch.long)
    pad[0, 33:] = 0
    torch.testing.assert_close(ours(ids, attention_mask=pad).logits[0, :33], ref(ids, attention_mask=pad).logits[0, :33], rtol=0, atol=1e-12)


def test_the_kernel_is_chosen_per_call_through_fm_impl():
    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf

    model = tiny_llama(fm_hf.register()).eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    mask = masks.document([15, 25])
    blockwise = model(ids, flashmask=mask, fm_impl="torch").logits
    torch.testing.assert_close(model(ids, flashmask=mask, fm_impl="dense").logits, blockwise, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="impl: 'cute' needs CUDA tensors, got device cpu"):
        model(ids, flashmask=mask, fm_impl="cute")  # reached flashmask_attention, which refused it


def test_bad_name_and_dropout():
    from fm_parallel.integrations import transformers as fm_hf

    with pytest.raises(ValueError, match="expected no 'flash' in it"):
        fm_hf.register("my_flash_backend")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout: expected 0.0"):
        fm_hf.attention_forward(None, q, q, q, None, dropout=0.1)


def _doc_labels(ids, lengths):
    labels = torch.full_like(ids, -100)
    start = 0
    for n in lengths:
        labels[:, start : start + n - 1] = ids[:, start + 1 : start + n]
        start += n
    return labels


def lora_under_cp(rank, world, mode, balance):
    import torch.distributed as dist
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model

    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel
    from fm_parallel.integrations import transformers as fm_hf

    name = fm_hf.register()
    model = get_peft_model(tiny_llama(name), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lengths = [20, 30, 14]
    mask = masks.document(lengths)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    labels = _doc_labels(ids, lengths)
    count = int((labels != -100).sum())
    lora = [p for n, p in model.named_parameters() if p.requires_grad]

    def loss_of(logits, lab):
        return F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum") / count

    full = loss_of(model(ids, flashmask=mask).logits, labels)
    full.backward()
    want = [p.grad.clone() for p in lora]
    model.zero_grad()

    plan = shard(mask, world, balance)
    mesh = None
    if mode == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ctx = ContextParallel(mode, plan, mesh=mesh)
    logits = model(plan.shard(ids, rank), position_ids=plan.position_ids(rank)[None], flashmask=mask, fm_context=ctx).logits
    local = loss_of(logits, plan.shard(labels, rank))
    local.backward()
    total = local.detach().clone()
    dist.all_reduce(total)
    grad_err = 0.0
    for p, w in zip(lora, want):
        g = p.grad.clone()
        dist.all_reduce(g)
        grad_err = max(grad_err, (g - w).abs().max().item())
    return {"loss": total.item(), "want": full.item(), "grad_err": grad_err, "grad_scale": max(w.abs().max().item() for w in want)}


CP_CASES = [("ring", 2, "zigzag"), ("ulysses", 2, "mask"), ("hybrid", 4, "contiguous")]


@pytest.fixture(scope="module")
def under_cp():
    """The cases of each world size in one spawn: {mode: each rank's result}."""
    got = {}
    for world in (2, 4):
        got.update(run_cases(world, {mode: (lora_under_cp, (mode, balance)) for mode, w, balance in CP_CASES if w == world},
                             timeout=400))
    return got


@pytest.mark.parametrize("mode, world, balance", CP_CASES)
def test_lora_loss_and_gradients_under_context_parallelism(under_cp, mode, world, balance):
    for res in under_cp[mode]:
        assert "exception" not in res, res.get("traceback")
        assert res["loss"] == pytest.approx(res["want"], rel=1e-12, abs=1e-12)
        assert res["grad_err"] <= 1e-10 * max(res["grad_scale"], 1.0)
        assert res["grad_scale"] > 0


def test_the_default_mask_is_built_once_per_length_and_knows_it_is_causal():
    from fm_parallel.integrations.transformers import _default_mask

    a = _default_mask(48, True, torch.device("cpu"))
    assert a is _default_mask(48, True, torch.device("cpu")) and a.causal_documents() == (48,)
    assert _default_mask(48, False, torch.device("cpu")).causal_documents() is None


def test_raw_bounds_get_flashmask_attentions_checks_once_per_forward(monkeypatch):
    """``model(ids, fms=..., fme=...)``: the caller's bounds are checked like ``flashmask_attention``'s
    (before: AttributeError, silently ignored, or computed on garbage; issue 35.2), once per forward."""
    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.masks import flashmask

    model = tiny_llama(fm_hf.register()).eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    mask = masks.document([15, 25])
    fms, fme = mask.fms.clone(), mask.fme.clone()
    calls = []
    real = flashmask._validate
    monkeypatch.setattr(flashmask, "_validate", lambda *a: (calls.append(1), real(*a))[1])
    with torch.no_grad():
        got = model(ids, fms=fms, fme=fme).logits
        assert len(calls) == 1  # two layers, one check
        torch.testing.assert_close(got, model(ids, flashmask=mask).logits, rtol=0, atol=0)

        def bad(**kw):
            return model(ids, **kw)

        two = torch.cat([fms, fms], -1)  # [1, 1, 40, 2]: the same interval twice
        wide = fme.clone()
        wide[0, 0, 3] = 40
        neg = fms.clone()
        neg[0, 0, 5] = -1
        for kw, message in [
            (dict(fms=fms), "fms, fme: expected both or neither, got only fms"),
            (dict(fme=fme), "fms, fme: expected both or neither, got only fme"),
            (dict(fms=two, fme=torch.cat([fme, fme], -1)), "fms/fme: expected the non-empty intervals of each column sorted and disjoint"),
            (dict(fms=fms, fme=wide), r"fme: expected rows < num_rows = 40 \(bounds are inclusive\), got fme\[0, 0, 3, 0\] = 40"),
            (dict(fms=neg, fme=fme), r"fms: expected rows >= 0, got fms\[0, 0, 5, 0\] = -1"),
            (dict(fms=fms[:, :, :30], fme=fme[:, :, :30]), "fms: expected 40 key columns .*, got 30"),
            (dict(fms=fms.float(), fme=fme), "fms: expected an integer dtype"),
            (dict(fms=fms.tolist(), fme=fme), "fms: expected an integer torch.Tensor"),
            (dict(flashmask=mask.to_dense()), "flashmask: expected a FlashMask .*, got Tensor"),
            (dict(flashmask=mask, fms=fms, fme=fme), "flashmask: expected a FlashMask or fms/fme, got both"),
        ]:
            with pytest.raises(ValueError, match=message):
                bad(**kw)
