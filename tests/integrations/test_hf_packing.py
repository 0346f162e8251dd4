"""What Hugging Face users pass, the right mask without writing one: packing from ``cu_seq_lens_*`` and
``position_ids`` (compared with every document run alone), padding on either side, a KV cache in
``generate()`` (compared with ``sdpa``), autocast, and the derivation made once per forward."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=r".*past_key_values.*deprecated")


@pytest.fixture(scope="module")
def models():
    from fm_parallel.integrations import transformers as fm_hf

    return tiny_llama(fm_hf.register()).eval(), tiny_llama("sdpa").eval()


def documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_flattened_batches_equal_each_document_alone(models, flash_kwargs):
    from transformers import DataCollatorWithFlattening

    ours, ref = models
    docs = documents([7, 12, 1, 9])
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    assert ("cu_seq_lens_k" in batch) == flash_kwargs
    with torch.no_grad():
        alone = torch.cat([ref(torch.tensor([d])).logits for d in docs], 1)
        got = ours(**batch, use_cache=False).logits
        leak = (ref(**batch, use_cache=True).logits - alone).abs().max()  # what a cache-enabled sdpa forward does
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-12)
    assert leak > 1e-3  # the comparison can fail: attending across documents changes the logits


def test_an_explicit_flashmask_wins_over_position_ids(models):
    from fm_parallel import masks

    ours, ref = models
    ids = torch.tensor([sum(documents([10, 10]), [])])
    positions = torch.cat([torch.arange(10), torch.arange(10)]).view(1, -1)  # says two documents
    with torch.no_grad():
        got = ours(ids, position_ids=positions, flashmask=masks.causal(20)).logits  # one causal sequence
        want = ref(ids, position_ids=positions, attention_mask=torch.ones(1, 20, dtype=torch.long)).logits  # sdpa: no packing
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_on_either_side_matches_sdpa(models, side):
    ours, ref = models
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(3))
    att = torch.ones(3, 24, dtype=torch.long)
    for row, pad in ((0, 5), (2, 11)):
        if side == "left":
            att[row, :pad] = 0
        else:
            att[row, 24 - pad:] = 0
    positions = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, attention_mask=att, position_ids=positions).logits
        want = ref(ids, attention_mask=att, position_ids=positions).logits
    real = att.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-12)


def test_a_decode_step_with_a_kv_cache_equals_the_full_forward(models):
    ours, _ = models
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = ours(ids, use_cache=False).logits
        prefix = ours(ids[:, :21], use_cache=True)
        cache = prefix.past_key_values
        for t in range(21, 30):  # one token at a time: queries are the last row of the keys
            step = ours(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            torch.testing.assert_close(step.logits[:, 0], full[:, t], rtol=0, atol=1e-12)
        chunk = ours(ids[:, 21:], past_key_values=ours(ids[:, :21], use_cache=True).past_key_values, use_cache=True).logits
    torch.testing.assert_close(chunk, full[:, 21:], rtol=0, atol=1e-12)  # several queries under a cache


def test_greedy_generate_returns_the_tokens_of_sdpa(models):
    ours, ref = models
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(5))
    att = torch.ones(3, 12, dtype=torch.long)
    att[1, :4] = 0  # a left-padded prompt in the batch
    kwargs = dict(attention_mask=att, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_autocast_and_mixed_dtypes_compute_like_sdpa():
    from fm_parallel import flashmask_attention
    from fm_parallel.integrations import transformers as fm_hf

    q = torch.randn(1, 4, 33, 16, requires_grad=True)  # fp32, as after a rotary embedding in fp32
    k, v = torch.randn(1, 2, 33, 16).bfloat16(), torch.randn(1, 2, 33, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flashmask_attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    got.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):  # outside autocast mixed dtypes are an error, as in sdpa
        flashmask_attention(q, k, v)
    # A model in fp32 under bf16 autocast trains (TRL's bf16=True), close to sdpa under the same autocast.
    ours, ref = tiny_llama(fm_hf.register()).float(), tiny_llama("sdpa").float()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(ids, labels=ids).loss, ref(ids, labels=ids).loss
    a.backward()
    assert abs(a.item() - b.item()) < 2e-2 and all(p.grad is not None for p in ours.parameters() if p.requires_grad)


def test_the_packed_mask_is_derived_once_per_forward(models, monkeypatch):
    from transformers import DataCollatorWithFlattening

    from fm_parallel.integrations import transformers as fm_hf

    ours, _ = models
    calls = {"positions": 0}
    real = fm_hf._documents_from_positions

    def counting(*args, **kwargs):
        calls["positions"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fm_hf, "_documents_from_positions", counting)
    for seed in range(3):
        batch = DataCollatorWithFlattening()([{"input_ids": d} for d in documents([5, 9, 6], seed)])
        batch.pop("labels")
        with torch.no_grad():
            ours(**batch, use_cache=False)
    assert calls["positions"] == 3  # one per forward, not one per layer (the model has 2)


def test_position_derived_documents_match_the_builder():
    from fm_parallel import masks
    from fm_parallel.integrations.transformers import _documents_from_positions

    lengths = [3, 1, 7, 5]
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    for causal in (True, False):
        got = _documents_from_positions(positions, 2, 16, causal, torch.device("cpu"))
        want = masks.document(lengths, causal=causal)
        assert torch.equal(got.to_dense()[0], want.to_dense()[0]) and torch.equal(got.to_dense()[1], want.to_dense()[0])


def test_greedy_generate_with_a_static_cache_returns_the_tokens_of_sdpa(models):
    """A static cache holds slots not written yet after the queries: the queries sit where transformers
    says (its q_offset), not at the end of the keys, and the empty slots are seen by no query."""
    ours, ref = models
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(7))
    att = torch.ones(3, 12, dtype=torch.long)
    att[2, :5] = 0
    kwargs = dict(attention_mask=att, max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_a_4d_attention_mask_from_the_caller_is_honoured(models):
    """A 4-D mask the user builds reaches the attention function untouched: it is used (compressed to a
    FlashMask), never dropped for a causal one."""
    from fm_parallel import masks

    ours, ref = models
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(8))
    dense = masks.union(masks.document([10, 20]), masks.prefix_lm(30, 6)).to_dense()  # [1, 1, 30, 30] bool
    with torch.no_grad():
        got = ours(ids, attention_mask=dense).logits
        want = ref(ids, attention_mask=dense).logits
        causal = ours(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - causal).abs().max() > 1e-3
    with pytest.raises(ValueError, match="a 4-D mask and a FlashMask"):
        ours(ids, attention_mask=dense, flashmask=masks.causal(30))


def test_a_sliding_window_model_matches_sdpa_in_forward_and_generate():
    """Mistral-style configs pass ``sliding_window`` to the attention function: it is intersected into the
    mask, never ignored (ignoring it would attend past the window, silently)."""
    from transformers import MistralConfig, MistralForCausalLM

    from fm_parallel.integrations import transformers as fm_hf

    def mistral(attention):
        cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=256, sliding_window=8, attn_implementation=attention)
        torch.manual_seed(0)
        return MistralForCausalLM(cfg).double().eval()

    ours, ref = mistral(fm_hf.register()), mistral("sdpa")
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    att = torch.ones(2, 30, dtype=torch.long)
    att[1, :5] = 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-12)
        kwargs = dict(attention_mask=att, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))


@pytest.mark.parametrize("feature", ["s_aux", "softcap"])
def test_attention_features_we_do_not_implement_are_refused(feature):
    from fm_parallel.integrations.transformers import attention_forward

    q = k = v = torch.randn(1, 2, 8, 16)
    value = torch.zeros(2) if feature == "s_aux" else 30.0
    with pytest.raises(ValueError, match=f"{feature}: this model's attention uses {feature}"):
        attention_forward(torch.nn.Module(), q, k, v, None, **{feature: value})


@pytest.mark.parametrize("tiled", [False, True], ids=["model", "tiled layers"])
def test_a_float64_model_under_bf16_autocast_runs_as_sdpa_does(tiled):
    """Autocast never casts float64 tensors: SDPA in a float64 model under ``bf16`` autocast (TRL's
    ``bf16=True``) runs in float64. Ours cast q, k, v to bfloat16 and the next projection raised a dtype
    error (found through the long-context components under TRL)."""
    from fm_parallel import flashmask_attention
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context

    q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.float64) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flashmask_attention(q, k, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ours, ref = tiny_llama(fm_hf.register()), tiny_llama("sdpa")
    if tiled:
        long_context(ours, tile_chunk=8, attention_chunk=16)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(ids, labels=ids).loss, ref(ids, labels=ids).loss
        a.backward()
        b.backward()
    assert a.dtype == b.dtype and abs(a.item() - b.item()) < 1e-9
    # (1e-7: HF's norms compute in float32 even here, so reordered float64 sums move float32 ulps; the
    # same without autocast)
    for (name, p), r in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7, msg=name)
