"""GPU check of the public memory plan (``fm_parallel.longcontext.measure_budget`` /
``plan_long_context``) on an HF Llama with the components and a peft LoRA: the plan, made for stated
device memory that cannot keep every checkpoint, holds the real step, within 1 GiB above its peak.

    python -m pytest -q -rs tests/gpu/test_longcontext_plan.py
"""

import pytest
import torch

from tests.gpu import needs_cuda


@needs_cuda
@pytest.mark.xfail(strict=True, reason="the public plan undershot this step's peak on an H100 (2026-12-07): 3.30 GiB "
                   "planned (less the optimizer states), 3.61 GiB measured (0.64 GiB short with lengths 8k / 16k); "
                   "not explained yet: the trainer's own plan (tests/gpu/test_memory_plan.py) is the validated one")
def test_the_plan_from_a_measured_budget_holds_the_step():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.longcontext import long_context, measure_budget, plan_long_context
    from fm_parallel.longcontext.memory import MARGIN_PER_TOKEN, inputs_held
    from fm_parallel.longcontext.plan import PhasePeaks, _watch_final_hidden

    config = LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=2048, vocab_size=32000, max_position_embeddings=131072)
    config._attn_implementation = fm_hf.register()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    settings = dict(tile_chunk=4096, attention_chunk=8192, loss_chunk=4096)
    long_context(model, offload_layers=-1, **settings)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    budget = measure_budget(model, (16384, 32768))  # two attention chunks and more: every tiled path runs
    n = 131072
    roomy = plan_long_context(model, n, budget, device_gib=200, host_gib=200)
    assert (roomy.every, roomy.offload_layers) == (1, 0)
    ckpt = n * 1024 * 2
    stated = (roomy.device_bytes - 3.5 * ckpt) / 2**30  # room for all but 3.5 checkpoints: 4 to the host
    plan = plan_long_context(model, n, budget, device_gib=stated, host_gib=200)
    assert plan.every == 1 and plan.offload_layers == 4, plan
    long_context(model, checkpoint_every=plan.every, offload_layers=plan.offload_layers, **settings)
    ids = torch.randint(0, 32000, (1, n), device="cuda")
    torch.cuda.synchronize()
    base = model.get_base_model()
    peaks = PhasePeaks(torch.device("cuda"))  # the step's peaks phase by phase, as the plan predicts them
    _watch_final_hidden(base, peaks)
    loss = model(input_ids=ids, labels=ids, flashmask=masks.causal(n).to("cuda"),
                 position_ids=torch.arange(n, device="cuda").view(1, n)).loss
    peaks.end("forward")
    loss.backward()
    del loss
    peaks.finish()
    torch.cuda.synchronize()
    _watch_final_hidden(base, None)
    peak = peaks.overall
    # Each phase against its line: where a miss comes from (the checkpoints a phase holds, or the line).
    ckpt_count = {p: inputs_held(p, 8, plan.every, 4) for p in budget.lines}
    by_phase = {p: (round(v / 2**30, 3), round((budget.lines[p][0] + (budget.lines[p][1] + MARGIN_PER_TOKEN) * n
                                                + ckpt_count[p] * ckpt) / 2**30, 3), ckpt_count[p])
                for p, v in peaks.peaks.items() if p in budget.lines}
    print(f"plan {plan}; measured peak {peak / 2**30:.2f} GiB; per phase (measured, predicted, checkpoints held): {by_phase}")
    # The optimizer's states are in the plan's static memory but not allocated here (no optimizer):
    # the bound compares the step's peak with the plan less them.
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    predicted = plan.device_bytes - 2 * trainable
    assert peak <= predicted and predicted - peak < 2**30, (peak / 2**30, predicted / 2**30, by_phase)
