"""DeepSpeed sequence parallelism with FlashMask attention, on gloo: DistributedAttention with our
local attention, and the Hugging Face Ulysses wrapper (ALST) keeping packed-document masks."""

import os

import pytest
import torch

from tests.distributed.spawn import run_cases, run_ranks

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
# DeepSpeed builds a shared-memory comm op for CPU ranks the first time (30-70 s); keep it between runs.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fm_parallel/torch_extensions"))


def distributed_attention(rank, world, balance):
    import deepspeed.comm as dcomm
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    from fm_parallel import flashmask_attention, masks
    from fm_parallel.distributed import shard
    from fm_parallel.integrations.deepspeed import FlashMaskLocalAttention

    dcomm.init_distributed(dist_backend="gloo")
    mask = masks.dpo(30, 17, 17)
    plan = shard(mask, world, balance)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = flashmask_attention(q, k, v, mask=mask)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    local = FlashMaskLocalAttention(mask, plan=None if balance == "contiguous" else plan)
    attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    # DeepSpeed's layout: [B, S / P, H, D]
    ql, kl, vl = (plan.shard(t.detach(), rank, 2).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    out = attn(ql, kl, vl, 0)
    out.backward(plan.shard(dout, rank, 2).transpose(1, 2))
    err = lambda a, b: (a.transpose(1, 2) - plan.shard(b, rank, 2)).abs().max().item()  # noqa: E731
    return {"out": err(out.detach(), ref.detach()), "dq": err(ql.grad, q.grad), "dk": err(kl.grad, k.grad), "dv": err(vl.grad, v.grad)}


@pytest.fixture(scope="module")
def attention_runs():
    """Both balance modes and (last: it wraps the HF attention of its process) the Ulysses HF wrapper in one 2-rank spawn."""
    cases = {balance: (distributed_attention, (balance,)) for balance in ("contiguous", "zigzag")}
    cases["ulysses_hf"] = (ulysses_hf, ())
    return run_cases(2, cases, timeout=600)


@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
def test_distributed_attention_with_flashmask(attention_runs, balance):
    for res in attention_runs[balance]:
        assert "exception" not in res, res.get("traceback")
        assert max(res.values()) < 1e-10, res


def ulysses_hf(rank, world):
    import deepspeed.comm as dcomm
    import torch.distributed as dist
    import torch.nn.functional as F

    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.deepspeed import register_ulysses_hf
    from tests.helpers import tiny_llama
    from tests.integrations.test_transformers import _doc_labels

    dcomm.init_distributed(dist_backend="gloo")
    name = fm_hf.register()
    model = tiny_llama(name)
    register_ulysses_hf(model, sequence_parallel_size=world, disable_in_eval=True)
    lengths = [20, 30, 14]
    mask = masks.document(lengths)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    labels = _doc_labels(ids, lengths)
    count = int((labels != -100).sum())
    pos = torch.arange(64).view(1, -1)

    def loss(logits, lab):
        return F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum") / count

    # The reference: each document on its own, no sequence parallelism (eval mode skips the wrapper).
    model.eval()
    with torch.no_grad():
        want = sum(loss(model(ids[:, s:e], position_ids=pos[:, s:e]).logits, labels[:, s:e]).item()
                   for s, e in ((0, 20), (20, 50), (50, 64)))
    model.train()
    sl = slice(rank * 64 // world, (rank + 1) * 64 // world)
    got = loss(model(ids[:, sl], position_ids=pos[:, sl], flashmask=mask).logits, labels[:, sl]).detach()
    dist.all_reduce(got)
    causal = loss(model(ids[:, sl], position_ids=pos[:, sl]).logits, labels[:, sl]).detach()  # what a dropped mask gives
    dist.all_reduce(causal)
    return {"got": got.item(), "want": want, "causal": causal.item()}


def test_ulysses_hf_keeps_packed_document_masks(attention_runs):
    for res in attention_runs["ulysses_hf"]:
        assert "exception" not in res, res.get("traceback")
        assert res["got"] == pytest.approx(res["want"], rel=1e-10)
        assert abs(res["causal"] - res["want"]) > 1e-6  # without the FlashMask the documents would mix


def _lora_llama(attention):
    from peft import LoraConfig, get_peft_model

    from tests.helpers import tiny_llama

    return get_peft_model(tiny_llama(attention).float(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _packed_batch():
    from fm_parallel import masks
    from tests.integrations.test_transformers import _doc_labels

    lengths = [20, 30, 14]
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    labels = _doc_labels(ids, lengths)
    return ids, labels, masks.document(lengths), int((labels != -100).sum())


def zero_training(rank, world, stage):
    """Three LoRA steps through ``deepspeed.initialize`` (ZeRO ``stage``) with the Ulysses plugin."""
    import deepspeed
    import deepspeed.comm as dcomm
    import torch.distributed.nn.functional as dfn
    import torch.nn.functional as F

    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.deepspeed import register_ulysses_hf
    from tests.helpers import tiny_llama

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # what torchrun would set
    dcomm.init_distributed(dist_backend="gloo")
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(fm_hf.register()).float()
    mpu = register_ulysses_hf(base, sequence_parallel_size=world)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config, mpu=mpu)
    ids, labels, mask, count = _packed_batch()
    shard = slice(rank * 64 // world, (rank + 1) * 64 // world)
    positions = torch.arange(64).view(1, -1)[:, shard]
    losses = []
    for _ in range(3):
        logits = engine(input_ids=ids[:, shard], position_ids=positions, flashmask=mask).logits
        local = F.cross_entropy(logits.flatten(0, 1).float(), labels[:, shard].flatten(), ignore_index=-100, reduction="sum") / count
        loss = dfn.all_reduce(local, group=mpu.get_sequence_parallel_group())  # the whole row's loss on every rank
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_initialize_zero_with_the_ulysses_plugin_trains_like_one_process(stage):
    import torch.nn.functional as F

    from fm_parallel.integrations import transformers as fm_hf

    model = _lora_llama(fm_hf.register())  # the same initial weights and LoRA init as every rank
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, labels, mask, count = _packed_batch()
    want = []
    for _ in range(3):
        logits = model(input_ids=ids, position_ids=torch.arange(64).view(1, -1), flashmask=mask).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum") / count
        loss.backward()
        optim.step()
        optim.zero_grad()
        want.append(loss.item())
    for res in run_ranks(zero_training, 2, stage, timeout=500):
        assert "exception" not in res, res.get("traceback")
        assert res["losses"] == pytest.approx(want, rel=1e-5), (res, want)
    assert want[-1] < want[0]  # it trained
