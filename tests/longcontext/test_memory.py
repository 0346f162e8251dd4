"""No N x N tensor anywhere in a training step: a dispatch-mode probe records the largest tensor
every operator produces (forward and backward) and the step must stay well under N^2 elements."""

import json
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fm_parallel import flashmask_attention, masks

pytest.importorskip("transformers")
pytest.importorskip("peft")
N = 2048


class LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def test_probe_catches_a_dense_mask():
    q = torch.randn(1, 1, N, 8)
    with LargestTensor() as probe:
        flashmask_attention(q, q, q, attn_mask=masks.causal(N).to_dense()[0, 0], impl="dense")
    assert probe.largest >= N * N // 2


@pytest.mark.parametrize("switches", [[], ["--model.tile_chunk", "256"]], ids=["plain", "tiled"])
def test_a_training_step_never_builds_an_n_by_n_tensor(tmp_path, switches):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    cfg = load_config(["--model.hidden_size", "64", "--model.layers", "2", "--model.intermediate_size", "128",
                       "--data.seq_len", str(N), "--training.steps", "1", "--training.loss_chunk", "256",
                       "--parallel.cp", "none", "--output.dir", str(tmp_path), "--output.checkpoint_every", "0", *switches],
                      environ={})
    with LargestTensor() as probe:
        summary = train(cfg)
    assert summary["steps"] == 1
    # The largest tensors are the PyTorch path's score tiles, heads x block x N (4 x 128 x N here),
    # linear in N; anything N x N (a dense mask or score matrix) would be at least N^2.
    assert probe.largest <= 4 * 128 * N < N * N, f"{probe.op} produced {probe.largest} elements (N^2 = {N * N})"


@pytest.mark.parametrize("offload", [0, 1, 2])
def test_offloaded_checkpoints_hold_exactly_the_layer_inputs_and_change_nothing(tmp_path, offload):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    n, hidden = 512, 64
    args = ["--model.hidden_size", str(hidden), "--model.layers", "2", "--model.intermediate_size", "128",
            "--data.seq_len", str(n), "--training.steps", "2", "--parallel.cp", "none", "--output.checkpoint_every", "0"]
    plain = train(load_config(args + ["--output.dir", str(tmp_path / "plain")], environ={}))
    moved = train(load_config(args + ["--output.dir", str(tmp_path / "moved"), "--model.offload_layers", str(offload)], environ={}))
    assert moved["first_loss"] == plain["first_loss"] and moved["final_loss"] == plain["final_loss"]
    records = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()]
    # Each offloaded layer keeps exactly its input [1, n, hidden] fp32 on the host; the layer's internals
    # are recomputed, and keyword inputs (the rotary tables, the mask) are shared by all layers, not copied.
    assert records[-1].get("host_gib", 0.0) * 2**30 == offload * n * hidden * 4


def test_offload_layers_is_validated(tmp_path):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    cfg = load_config(["--model.layers", "2", "--model.offload_layers", "3", "--parallel.cp", "none",
                       "--output.dir", str(tmp_path)], environ={})
    with pytest.raises(ValueError, match=r"model.offload_layers: expected -1 \(all\) or 0..2 \(model.layers\), got 3"):
        train(cfg)  # against the built model's layer count (a model.path folder's: its config.json, tests/trainer/test_model.py)
    with pytest.raises(ValueError, match=r"offload_layers: expected a value >= 0 or -1, got -2"):
        load_config(["--model.offload_layers", "-2"], environ={})  # the key's own range: at load


def test_baseline_attention_needs_one_device(tmp_path):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    with pytest.raises(ValueError, match="model.attention: expected flashmask, sdpa or flex, got 'xformers'"):
        load_config(["--model.attention", "xformers"], environ={})
    cfg = load_config(["--model.attention", "sdpa", "--parallel.cp", "ring", "--parallel.cp_degree", "2",
                       "--output.dir", str(tmp_path)], environ={})
    with pytest.raises(ValueError, match="single-device baseline"):
        train(cfg)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_baseline_attention_gives_the_flashmask_losses(tmp_path, attention):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    if attention == "flex" and not torch.cuda.is_available():
        pytest.skip("FlexAttention has no CPU backward (torch raises NotImplementedError); checked on the GPU")
    args = ["--model.hidden_size", "64", "--model.layers", "2", "--model.intermediate_size", "128", "--data.seq_len", "512",
            "--training.steps", "2", "--parallel.cp", "none", "--output.checkpoint_every", "0"]
    ours = train(load_config(args + ["--output.dir", str(tmp_path / "fm")], environ={}))
    theirs = train(load_config(args + ["--output.dir", str(tmp_path / attention), "--model.attention", attention], environ={}))
    assert theirs["first_loss"] == pytest.approx(ours["first_loss"], rel=1e-4)
    assert theirs["final_loss"] == pytest.approx(ours["final_loss"], rel=1e-4)


def test_tiled_gives_the_same_losses(tmp_path):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.loop import train

    base = ["--model.hidden_size", "64", "--model.layers", "2", "--model.intermediate_size", "128", "--data.seq_len", "512",
            "--training.steps", "2", "--parallel.cp", "none", "--output.checkpoint_every", "0"]
    plain = train(load_config(base + ["--output.dir", str(tmp_path / "a")], environ={}))
    tiled = train(load_config(base + ["--output.dir", str(tmp_path / "b"), "--model.tile_chunk", "100"], environ={}))
    assert tiled["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)
    assert tiled["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)


def _saved_bytes_per_token(tile_chunk: int, n: int = 1024, dtype: str = "float32") -> float:
    """Bytes the forward of the decoder saves for the backward, per token and layer (no outer checkpoint)."""
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.model import build_model as _build_model, hidden as _hidden

    cfg = load_config(["--model.hidden_size", "64", "--model.layers", "2", "--model.intermediate_size", "256",
                       "--model.activation_checkpointing", "false", "--model.tile_chunk", str(tile_chunk),
                       "--model.dtype", dtype, "--parallel.cp", "none"], environ={})
    model = _build_model(cfg, 258, torch.device("cpu"))
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _hidden(model, torch.randint(0, 258, (1, n)), torch.arange(n).view(1, n), masks.causal(n), None, "auto")
    return sum(b for b in seen.values() if b >= n * 64 * 4 // 4) / n / 2  # tensors of at least N x hidden/4 values


def test_tiled_layers_save_a_few_hidden_sized_tensors_per_token():
    plain, tiled = _saved_bytes_per_token(0, dtype="bfloat16"), _saved_bytes_per_token(128, dtype="bfloat16")
    hidden_bf16 = 64 * 2
    # Tiled: the layer input, q, k, v (k and v at half width with 2 of 4 heads) and the attention
    # output, 4 x hidden per layer, plus the embedding output and the final norm's share (measured
    # 5.5 x hidden per layer, 6.0 before the final norm was tiled); untiled the norms' float32
    # copies, the rotary and MLP intermediates make it 29 x hidden.
    assert tiled <= 5.75 * hidden_bf16, tiled / hidden_bf16
    assert plain >= 4 * tiled, (plain / hidden_bf16, tiled / hidden_bf16)


def test_tiling_and_offload_name_what_a_model_lacks():
    from fm_parallel.longcontext.memory import checkpoint_layers
    from fm_parallel.longcontext.tiling import tile_decoder_layers

    class Odd(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(layers)

    with pytest.raises(ValueError, match=r"layer 0 \(Linear\) has no input_layernorm, post_attention_layernorm, mlp, self_attn"):
        tile_decoder_layers(Odd([torch.nn.Linear(2, 2)]), 128)
    with pytest.raises(ValueError, match="chunk: expected a positive number of tokens, got 0"):
        tile_decoder_layers(Odd([torch.nn.Linear(2, 2)]), 0)
    with pytest.raises(ValueError, match=r"model: expected a decoder with `.model.layers`, got Odd"):
        checkpoint_layers(Odd([]))


def test_expandable_segments_are_asked_for_only_before_cuda_and_never_over_the_users_choice(monkeypatch):
    from fm_parallel.longcontext import memory

    for name in memory.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not memory.prefer_expandable_segments() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not memory.prefer_expandable_segments() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # too late
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    assert not memory.prefer_expandable_segments() and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # the user's
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    assert memory.prefer_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert not memory.prefer_expandable_segments()  # set once; the second call sees it as set
