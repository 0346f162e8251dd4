"""GPU check of the tiled decoder layer (fm_parallel/longcontext/tiling.py) with the CUDA backends, bf16:
attention per query chunk gives the loss and LoRA gradients of one call over the whole sequence, and
of the untiled layer, on packed documents (chunks cut between them: FA4's varlen kernel per chunk)
and on one long document (chunks inside it: windows that overlap, block-sparse kernels, key
gradients added in float32).

    FM_FA4_SITE=/tmp/site python -m pytest -q -rs tests/gpu/test_tiling.py     # on the H200
"""

import pytest
import torch

from fm_parallel import masks
from tests.gpu import needs_cuda

N = 32768


def _run(tile: int, attention_chunk: int, mask, impl: str, *extra: str):
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.model import build_model, hidden
    from fm_parallel.longcontext.loss import chunked_cross_entropy

    argv = ["--model.hidden_size", "1024", "--model.layers", "2", "--model.heads", "8", "--model.kv_heads", "2",
            "--model.intermediate_size", "2048", "--parallel.cp", "none", "--model.tile_chunk", str(tile),
            "--model.attention_chunk", str(attention_chunk), *extra]
    model = build_model(load_config(argv, environ={}), 1024, torch.device("cuda"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator("cuda").manual_seed(hash(name) % 2**31))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (1, N), generator=g).cuda()
    h = hidden(model, ids, torch.arange(N, device="cuda").view(1, N), mask, None, impl)
    loss = chunked_cross_entropy(model.get_base_model().lm_head, h[:, :-1], ids[:, 1:], 4096) / N
    loss.backward()
    return loss.item(), {k: p.grad.float() for k, p in model.named_parameters() if p.requires_grad}


def _close(got, want, loss_rel=2e-3, grad_rel=3e-2):
    assert got[0] == pytest.approx(want[0], rel=loss_rel)
    for name, w in want[1].items():
        g = got[1][name]
        rel = ((g - w).norm() / w.norm().clamp_min(1e-12)).item()
        assert rel < grad_rel, (name, rel)


@needs_cuda
@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("kind", ["documents", "one document"])
def test_attention_per_query_chunk_equals_one_call_and_the_untiled_layer(kind, impl):
    if impl == "auto" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("impl='auto' is the CuTe backend on Hopper only")
    host = masks.document(masks.sample_lengths(N)) if kind == "documents" else masks.causal(N)
    mask = host.to("cuda")
    chunked = _run(4096, 8192, mask, impl)  # model.compile = auto: the parts compiled on the GPU
    eager = _run(4096, 8192, mask, impl, "--model.compile", "off")
    whole = _run(4096, 0, mask, impl)
    untiled = _run(0, 0, mask, impl)
    _close(chunked, eager)
    _close(chunked, whole)
    _close(chunked, untiled)


@needs_cuda
def test_checkpoints_copied_to_the_host_on_a_side_stream_change_nothing():
    """HostOffload's copy out runs on its own stream: the same loss and gradients, bit for bit (Triton:
    its backward is deterministic; FA4's adds dQ with atomics, so two of its runs differ in rounding)."""
    mask = masks.document(masks.sample_lengths(N)).to("cuda")
    kept = _run(4096, 8192, mask, "triton")
    moved = _run(4096, 8192, mask, "triton", "--model.offload_layers", "-1")
    assert moved[0] == kept[0]
    for name, w in kept[1].items():
        assert torch.equal(moved[1][name], w), name
