"""The Hugging Face and trainer edges on a GPU: what tests/integrations/test_hf_packing.py and
tests/trainer check on the CPU, run through the CUDA kernels (``impl`` auto: CuTe on Hopper with the
[cute] extra, else Triton; ``--impl`` to force one).

    python launch/bench/verify_hf_gpu.py --out docs/benchmarks/verify_hf_gpu_h200.json

Cases (bf16 Llama, head dim 64; tolerances against what ``sdpa`` in the same dtype gets):
  packed_cu_seq_lens / packed_position_ids: DataCollatorWithFlattening batches vs each document alone;
  collator_dpo: shared-prompt DPO rows (FlashMaskCollator) vs the TRL layout's log-probs;
  decode: KV-cache decode steps vs the full forward; generate: greedy tokens vs sdpa (float32 model
  under bf16 autocast, where both compute in bf16); autocast: an fp32 model under bf16 autocast trains,
  loss vs sdpa; is_causal_top_left: Nq > Nk and Nq < Nk vs SDPA; digest: a GPU mask carries the
  host digest; trainer_resume: stop after 2 steps, resume, losses equal the uninterrupted run, the
  exported adapter reproduces the checkpoint.
Prints one line per case and writes JSON; exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


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
    batch = FlashMaskCollator(seq_len=2048)(samples)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script's own logic (PyTorch path, slow)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "verify_hf_gpu.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: this check runs the CUDA kernels; no GPU here (--device cpu for a dry run)")
    import torch.distributed as dist

    from fm_parallel import backends
    from fm_parallel.integrations import transformers as fm_hf

    device = torch.device(args.device)
    name = fm_hf.register()
    cases = {
        "packed_cu_seq_lens": lambda: case_packed(device, name, args.impl, True),
        "packed_position_ids": lambda: case_packed(device, name, args.impl, False),
        "collator_dpo": lambda: case_collator_dpo(device, name, args.impl),
        "decode": lambda: case_decode(device, name, args.impl),
        "generate": lambda: case_generate(device, name, args.impl),
        "autocast": lambda: case_autocast(device, name, args.impl),
        "is_causal_top_left": lambda: case_is_causal(device, args.impl),
        "digest": lambda: case_digest(device),
        "trainer_resume": lambda: case_trainer(device),
    }
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "impl": args.impl,
               "resolved": backends.resolve(args.impl, device), "cases": {}}
    for key, fn in cases.items():
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results["cases"][key] = res
        print(f"{'PASS' if res['ok'] else 'FAIL'} {key}: " + json.dumps({k: v for k, v in res.items() if k != 'traceback'}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    passed = sum(r["ok"] for r in results["cases"].values())
    print(f"{passed}/{len(cases)} passed ({results['resolved']}); json: {args.out}")
    raise SystemExit(0 if passed == len(cases) else 1)


if __name__ == "__main__":
    main()
