"""The Hugging Face and trainer edges on a GPU: what tests/integrations/test_hf_packing.py and
tests/trainer check on the CPU, run through the CUDA kernels (``impl`` auto: CuTe on Hopper with the
[cute] extra, else Triton; and Triton forced).

    python -m pytest -q -rs tests/gpu/test_hf.py          # on the H200 (FM_FA4_SITE for the CuTe backend)

Cases (bf16 Llama, head dim 64; tolerances against what ``sdpa`` in the same dtype gets):
packed_cu_seq_lens / packed_position_ids: DataCollatorWithFlattening batches vs each document alone;
collator_dpo: shared-prompt DPO rows (FlashMaskCollator) vs the TRL layout's log-probs; decode: KV-cache
decode steps vs the full forward; generate: greedy tokens vs sdpa (float32 model under bf16 autocast,
where both compute in bf16); autocast: an fp32 model under bf16 autocast trains, loss vs sdpa;
is_causal_top_left: Nq > Nk and Nq < Nk vs SDPA; digest: a GPU mask carries the host digest;
trainer_resume: stop after 2 steps, resume, losses equal the uninterrupted run, the exported adapter
exists. Was ``launch/bench/verify_hf_gpu.py`` (issue 32.3).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gpu import needs_cuda

pytestmark = [needs_cuda, pytest.mark.filterwarnings("ignore::UserWarning")]
IMPLS = ["auto", "triton"]


def llama(attention: str, dtype, device, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=4096, attn_implementation=attention)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def case_packed(device, name, impl, flash_kwargs):
    from transformers import DataCollatorWithFlattening

    ours, ref = llama(name, torch.bfloat16, device), llama("sdpa", torch.bfloat16, device)
    ref64 = llama("sdpa", torch.float64, "cpu")
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (700, 1, 1300, 257, 1838)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.no_grad():
        got = ours(**batch, use_cache=False, fm_impl=impl).logits[0]
        exact = torch.cat([ref64(torch.tensor([d])).logits[0] for d in docs])
        sdpa = torch.cat([ref(torch.tensor([d], device=device)).logits[0] for d in docs])
    err, base = rel(got.cpu(), exact), rel(sdpa.cpu(), exact)
    return {"rel_err": err, "sdpa_rel_err": base, "ok": err <= 2 * base + 1e-3}


def case_collator_dpo(device, name, impl):
    """Shared-prompt DPO rows from FlashMaskCollator (mask made on the CPU, moved once per forward):
    per-response log-probs vs the TRL layout in float64 on the CPU, within 2x of sdpa's bf16 error."""
    from fm_parallel.integrations.collator import FlashMaskCollator, response_logps

    ours, ref = llama(name, torch.bfloat16, device), llama("sdpa", torch.bfloat16, device)
    ref64 = llama("sdpa", torch.float64, "cpu")
    g = torch.Generator().manual_seed(5)
    samples = [{"prompt_ids": torch.randint(0, 512, (300,), generator=g).tolist(),
                "chosen_ids": torch.randint(0, 512, (200 + 10 * i,), generator=g).tolist(),
                "rejected_ids": torch.randint(0, 512, (150,), generator=g).tolist()} for i in range(6)]
    batch = FlashMaskCollator(seq_len=2048, preference=True)(samples)
    on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def layout_logps(model, dev):
        rows = []
        for smp in samples:
            pair = []
            for key in ("chosen_ids", "rejected_ids"):
                ids = torch.tensor([smp["prompt_ids"] + smp[key]], device=dev)
                logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
                pair.append(logp[len(smp["prompt_ids"]):].sum())
            rows.append(torch.stack(pair))
        return torch.stack(rows).cpu()

    with torch.no_grad():
        got = response_logps(ours(input_ids=on_device["input_ids"], position_ids=on_device["position_ids"],
                                  flashmask=batch["flashmask"], use_cache=False, fm_impl=impl).logits.double(), on_device).cpu()
        exact, sdpa = layout_logps(ref64, "cpu"), layout_logps(ref, device)
    err, base = rel(got, exact), rel(sdpa, exact)
    return {"rel_err": err, "sdpa_rel_err": base, "ok": err <= 2 * base + 1e-3}


def case_decode(device, name, impl):
    ours, ref = llama(name, torch.bfloat16, device), llama("sdpa", torch.bfloat16, device)
    ids = torch.randint(0, 512, (2, 1100), generator=torch.Generator().manual_seed(2)).to(device)
    worst, worst_sdpa = 0.0, 0.0
    with torch.no_grad():
        for model, key in ((ours, "ours"), (ref, "sdpa")):
            kw = {"fm_impl": impl} if model is ours else {}
            full = model(ids, use_cache=False, **kw).logits
            cache = model(ids[:, :1000], use_cache=True, **kw).past_key_values
            errs = []
            for t in range(1000, 1100, 7):
                step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True, **kw)
                cache = step.past_key_values
                errs.append(rel(step.logits[:, 0], full[:, t]))
                if t + 7 < 1100:  # feed the tokens skipped by the stride
                    cache = model(ids[:, t + 1 : t + 7], past_key_values=cache, use_cache=True, **kw).past_key_values
            if key == "ours":
                worst = max(errs)
            else:
                worst_sdpa = max(errs)
    return {"rel_err": worst, "sdpa_rel_err": worst_sdpa, "ok": worst <= 2 * worst_sdpa + 1e-2}


def case_generate(device, name, impl):
    ours, ref = llama(name, torch.float32, device), llama("sdpa", torch.float32, device)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(3)).to(device)
    att = torch.ones_like(ids)
    att[1, :9] = 0
    kw = dict(attention_mask=att, max_new_tokens=32, do_sample=False, pad_token_id=0)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        a = ours.generate(ids, **kw)  # generate() refuses unknown kwargs: the backend's auto choice
        b = ref.generate(ids, **kw)
    same = float((a == b).float().mean())
    return {"tokens_equal_share": same, "all_equal": bool(torch.equal(a, b)), "ok": same >= 0.95}


def case_autocast(device, name, impl):
    ours, ref = llama(name, torch.float32, device).train(), llama("sdpa", torch.float32, device).train()
    ids = torch.randint(0, 512, (2, 1024), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        a = ours(ids, labels=ids, fm_impl=impl).loss
        b = ref(ids, labels=ids).loss
    a.backward()
    grads = all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())
    return {"loss": a.item(), "sdpa_loss": b.item(), "ok": abs(a.item() - b.item()) < 1e-2 and grads}


def case_is_causal(device, impl):
    from fm_parallel import flashmask_attention

    out = {}
    ok = True
    for nq, nk in ((700, 300), (300, 700), (1, 513)):
        q = torch.randn(1, 4, nq, 64, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 4, nk, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        got = flashmask_attention(q, k, v, is_causal=True, impl=impl)
        base = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out[f"{nq}x{nk}"] = (rel(got, exact), rel(base, exact))
        ok &= rel(got, exact) <= 2 * rel(base, exact) + 1e-3
    return {"rel_err_vs_sdpa": out, "ok": ok}


def case_digest(device):
    from fm_parallel import masks

    m = masks.document([2, 30, 32])
    host = m.digest()
    moved = m.to(device)
    return {"ok": moved.digest() == host and masks.document([9, 44, 11]).to(device).digest() != host}


def case_trainer(device):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    work = Path(tempfile.mkdtemp())
    common = ["--model.hidden_size", "256", "--model.layers", "2", "--model.heads", "4", "--model.kv_heads", "2",
              "--model.intermediate_size", "512", "--data.seq_len", "4096", "--training.steps", "4",
              "--parallel.cp", "none", "--output.checkpoint_every", "0"]

    def losses(out):
        return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]

    train(load_config(common + ["--output.dir", str(work / "full")], environ={}))
    train(load_config(common + ["--output.dir", str(work / "part"), "--output.stop_after", "2"], environ={}))
    train(load_config(common + ["--output.dir", str(work / "part"), "--resume"], environ={}))
    want, got = losses(work / "full"), losses(work / "part")
    adapter = (work / "full" / "adapter" / "adapter_config.json").exists()
    return {"full": want, "resumed": got, "ok": adapter and len(got) == 4 and max(abs(a - b) for a, b in zip(got, want)) < 1e-3}


@pytest.fixture(scope="module")
def hf_name():
    pytest.importorskip("transformers")
    from fm_parallel.integrations import transformers as fm_hf

    return fm_hf.register()


@pytest.fixture
def device():
    return torch.device("cuda")


def _ok(result: dict) -> None:
    assert result["ok"], result


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["packed_cu_seq_lens", "packed_position_ids"])
def test_packed_batches_match_each_document_alone(device, hf_name, impl, flash_kwargs):
    _ok(case_packed(device, hf_name, impl, flash_kwargs))


@pytest.mark.parametrize("impl", IMPLS)
def test_collator_dpo_matches_the_trl_layout(device, hf_name, impl):
    _ok(case_collator_dpo(device, hf_name, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_kv_cache_decode_matches_the_full_forward(device, hf_name, impl):
    _ok(case_decode(device, hf_name, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_generate_matches_sdpa(device, hf_name, impl):
    _ok(case_generate(device, hf_name, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_autocast_trains_like_sdpa(device, hf_name, impl):
    _ok(case_autocast(device, hf_name, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_is_causal_is_top_left_like_sdpa(device, impl):
    _ok(case_is_causal(device, impl))


def test_a_gpu_mask_carries_the_host_digest(device):
    _ok(case_digest(device))


def test_the_trainer_resumes_to_the_same_losses(device):
    import torch.distributed as dist

    try:
        _ok(case_trainer(device))
    finally:  # the trainer starts a one-process group; the next test file must not inherit it
        if dist.is_initialized():
            dist.destroy_process_group()
