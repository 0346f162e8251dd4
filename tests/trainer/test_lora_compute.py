"""``model.lora_compute``: LoRA's products in the base weights' dtype (bfloat16 on a GPU) while the
adapters, their gradients and the optimizer's state stay float32 (peft's default copies each layer's
input to float32 and multiplies there). On the CPU in bfloat16: which dtype every LoRA product runs in
(seen at the dispatcher, so the test fails if one float32 product is left), the loss and gradients
against the float32 products within bfloat16 rounding, untiled and tiled, and through the trainer
command the float32 adapter it saves."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fm_parallel import masks
from tests.helpers import tiny_lora_llama

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
N = 300
RANK = 5  # no other dimension of the tiny model is 5: a matmul with a dimension of 5 is a LoRA product
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


class _LoraProducts(TorchDispatchMode):
    """The operand dtypes of every matrix product that touches a LoRA factor (a dimension of RANK)."""

    def __init__(self):
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(RANK in t.shape for t in tensors):
                self.dtypes.append(tuple(t.dtype for t in tensors))
        return func(*args, **(kwargs or {}))


def _run(compute: str, tile: int = 0):
    from fm_parallel.trainer.model import hidden

    model = tiny_lora_llama("--model.lora_compute", compute, "--model.lora_rank", str(RANK), "--model.tile_chunk",
                            str(tile), "--model.attention_chunk", "100", layers=2, dtype="bfloat16")
    ids = torch.randint(0, 258, (1, N), generator=torch.Generator().manual_seed(0))
    mask = masks.document([100, 120, 80])
    with _LoraProducts() as seen:
        h = hidden(model, ids, torch.arange(N).view(1, N), mask, None, "auto")
        logits = model.get_base_model().lm_head(h)[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        loss.backward()
    lora = {k: p for k, p in model.named_parameters() if p.requires_grad}
    return model, loss.item(), lora, seen.dtypes


@pytest.mark.parametrize("tile", [0, 64])
def test_lora_products_run_in_the_base_dtype_and_the_adapters_stay_float32(tile):
    _, want_loss, want, want_products = _run("float32", tile)
    model, got_loss, got, got_products = _run("base", tile)
    # peft's default: every LoRA product in float32 (the test sees them, so it would see one left behind)
    assert want_products and all(d == torch.float32 for ds in want_products for d in ds)
    assert len(got_products) == len(want_products)
    assert all(d == torch.bfloat16 for ds in got_products for d in ds), got_products
    assert got_loss == pytest.approx(want_loss, rel=1e-2)  # bfloat16 rounding of the adapter's output
    assert set(got) == set(want) and all(n for n in got)
    for name, p in got.items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), want[name].grad.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())
    before = {k: p.detach().clone() for k, p in got.items()}
    torch.optim.AdamW(got.values(), lr=1e-6).step()  # a step below bfloat16's resolution still moves them
    assert all(not torch.equal(p, before[k]) for k, p in got.items())


def test_the_adapter_state_is_the_same_in_both_modes():
    from peft import get_peft_model_state_dict

    states = [get_peft_model_state_dict(_run(compute)[0]) for compute in ("base", "float32")]
    assert {k: v.dtype for k, v in states[0].items()} == {k: v.dtype for k, v in states[1].items()}
    assert all(v.dtype == torch.float32 for v in states[0].values())


def test_the_trainer_saves_a_float32_adapter_from_a_bfloat16_run(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fm_parallel.launch", "--model.hidden_size", "64", "--model.layers", "2",
           "--model.heads", "4", "--model.kv_heads", "2", "--model.intermediate_size", "128", "--model.dtype", "bfloat16",
           "--data.seq_len", "256", "--training.steps", "2", "--training.warmup", "1", "--training.loss_chunk", "100",
           "--output.checkpoint_every", "0", "--parallel.cp", "none", "--output.dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MASTER_PORT=str(29500 + os.getpid() % 400)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = load_file(out / "adapter" / "adapter_model.safetensors")
    assert state and all(v.dtype == torch.float32 for v in state.values())
