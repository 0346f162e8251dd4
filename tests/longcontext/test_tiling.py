"""Tiled decoder layers (fm_parallel/longcontext/tiling.py): a layer is its own checkpoint keeping only its
input, its per-token parts run over tiles and FlashMask attention over query chunks. Exactness first:
float64 losses and LoRA gradients equal to the untiled layer's for every kind of chunk (between
documents, inside one long document, windows that overlap, rows that see nothing), with checkpoints
every k layers and on the host; then what it keeps, and which path it takes."""

import math
import shutil

import pytest
import torch

from fm_parallel import masks
from fm_parallel.masks.flashmask import FlashMask
from tests.helpers import tiny_lora_llama

pytest.importorskip("transformers")
pytest.importorskip("peft")

N = 300


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    """Llama's RMSNorm computes in float32 whatever its input: the tiled backward runs the first norm's
    backward once for the query part and once for the key part (linear in the gradient, so equal up to
    float32 rounding). In float64 the comparison is then exact to 1e-12, sharp enough to see any term
    missing or counted twice."""
    from transformers.models.llama import modeling_llama

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _model(tile: int = 0, attention_chunk: int = 65536, layers: int = 3, every: int = 1, offload: int = 0,
           checkpointing: bool = True, dtype: str = "float64", compile: str = "auto"):
    argv = ["--model.tile_chunk", str(tile), "--model.attention_chunk", str(attention_chunk),
            "--model.activation_checkpointing", str(checkpointing).lower(), "--model.compile", compile]
    if checkpointing:
        argv += ["--model.checkpoint_every", str(every), "--model.offload_layers", str(offload)]
    return tiny_lora_llama(*argv, layers=layers, dtype=dtype)


def _step(model, mask: FlashMask, batch: int = 1):
    from fm_parallel.trainer.model import hidden
    from fm_parallel.longcontext.tiles import tiled_sum

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (batch, N), generator=g)
    h = hidden(model, ids, torch.arange(N).view(1, N).expand(batch, N), mask, None, "auto")
    head = model.get_base_model().lm_head  # float64 logits (the trainer's chunked loss rounds them to float32)
    loss = tiled_sum(lambda h_, y_: torch.nn.functional.cross_entropy(head(h_).flatten(0, 1), y_.flatten(), reduction="sum"),
                     h[:, :-1], 64, ids[:, 1:])
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def _same(got, want):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert got_loss == pytest.approx(want_loss, rel=1e-12)
    assert set(got_grads) == set(want_grads) and len(got_grads) > 0
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-9, atol=1e-12, msg=name)


def _padded() -> FlashMask:
    """Documents [100, 150] then 50 padding tokens no row sees and that see nothing."""
    m = masks.document([100, 150, 50])
    fms, fme = m.fms.clone(), m.fme.clone()
    fms[..., 250:, 0], fme[..., 250:, 0] = N, -1
    return FlashMask(fms, fme, N)


MASKS = {
    "documents": lambda: masks.document([100, 120, 80]),
    "one document": lambda: masks.causal(N),
    "prefix-lm": lambda: masks.prefix_lm(N, 70),
    "window + sinks": lambda: masks.sliding_window(N, 40, 4),
    "dpo": lambda: masks.dpo(60, 50, 40, n=N),
    "padding": _padded,
    "padded documents": lambda: masks.document([90, 130, 50], n=N),
}


@pytest.mark.parametrize("chunk", [0, 100, 64])
@pytest.mark.parametrize("name", list(MASKS))
def test_tiled_layers_give_the_untiled_loss_and_gradients(name, chunk):
    mask = MASKS[name]()
    want = _step(_model(checkpointing=False), mask)
    _same(_step(_model(tile=50, attention_chunk=chunk), mask), want)


@pytest.mark.parametrize("every, offload", [(2, 0), (2, -1), (1, 2), (3, 1)])
def test_tiled_layers_under_checkpoints_every_k_layers_and_on_the_host(every, offload):
    mask = masks.document([100, 120, 80])
    want = _step(_model(checkpointing=False, layers=4), mask)
    _same(_step(_model(tile=50, attention_chunk=100, layers=4, every=every, offload=offload), mask), want)


def test_a_batch_of_two_rows_with_one_mask_each():
    mask = masks.stack([masks.document([100, 200]), masks.causal(N)])
    want = _step(_model(checkpointing=False), mask, batch=2)
    _same(_step(_model(tile=64, attention_chunk=96), mask, batch=2), want)


def test_the_chunks_end_between_documents_and_know_them():
    from fm_parallel.masks.chunks import attention_chunks

    chunks, overlap = attention_chunks(masks.document([100, 120, 80]), 128)
    assert [(c.r0, c.r1, c.k0, c.k1, c.local) for c in chunks] == [(0, 100, 0, 100, True), (100, 220, 100, 220, True),
                                                                  (220, 300, 220, 300, True)]
    assert not overlap
    assert [c.mask.causal_documents() for c in chunks] == [(100,), (120,), (80,)]  # FA4's varlen kernel on each
    # One long document: chunks of 128 rows, each seeing the keys before it; the windows overlap.
    chunks, overlap = attention_chunks(masks.causal(N), 128)
    assert [(c.r0, c.r1, c.k0, c.k1, c.local) for c in chunks] == [(0, 128, 0, 128, False), (128, 256, 0, 256, False),
                                                                  (256, 300, 0, 300, False)]
    assert overlap
    # A padded row: its mask is not "causal documents" as a whole, but each chunk of documents is.
    chunks, _ = attention_chunks(masks.document([100, 120, 50], n=N), 128)
    assert [(c.r0, c.r1, c.local) for c in chunks] == [(0, 100, True), (100, 220, True), (220, 300, True)]
    assert [c.mask.causal_documents() for c in chunks] == [(100,), (120,), None]  # the last holds the padding
    m = masks.causal(N)
    assert attention_chunks(m, 128) is attention_chunks(m, 128)
    with pytest.raises(ValueError, match="rows: expected a positive number of query rows per chunk, got 0"):
        attention_chunks(m, 0)


@pytest.mark.parametrize("name", list(MASKS))
def test_each_chunk_window_holds_every_key_its_rows_see(name):
    from fm_parallel.masks.chunks import attention_chunks

    mask = MASKS[name]()
    dense = mask.to_dense()[0, 0]  # [rows, keys]
    chunks, _ = attention_chunks(mask, 64)
    assert chunks[0].r0 == 0 and chunks[-1].r1 == N
    assert all(a.r1 == b.r0 and a.r1 - a.r0 <= 64 for a, b in zip(chunks, chunks[1:]))
    for c in chunks:
        seen = dense[c.r0 : c.r1].any(0).nonzero().flatten()
        if c.mask is None:
            assert seen.numel() == 0
            continue
        assert c.k0 <= int(seen.min()) and int(seen.max()) < c.k1
        sub = c.mask.to_dense(rows=c.positions)[0, 0]  # the chunk's own mask, as its kernel reads it
        assert torch.equal(sub, dense[c.r0 : c.r1, c.k0 : c.k1])


def test_the_chunked_path_runs_attention_per_chunk(monkeypatch):
    """Through the trainer's model with FlashMask and no CP, attention runs per query chunk through the
    backend's launchers (forward, the backward's recomputed forward, backward), never the whole sequence."""
    import fm_parallel.reference as ref

    calls = []
    for name in ("forward", "backward"):
        original = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda *a, _o=original, _n=name, **k: (calls.append((_n, a[0].shape[2])), _o(*a, **k))[1])
    _step(_model(tile=50, attention_chunk=100, layers=1), masks.document([100, 120, 80]))
    # Chunks 0-100 (a document), 100-200 (100 rows of the 120-token document), 200-300 (its rest and the
    # last document): forward, the backward's recomputed forward, backward each.
    assert sorted(calls) == sorted((p, n) for p in ("forward", "forward", "backward") for n in (100, 100, 100))


def test_a_tiled_layer_keeps_its_input_only():
    """Tensors saved for the backward by one training forward: the layer inputs (one [1, N, hidden] each)
    and the final norm's input and the loss's input, nothing per layer of q, k, v or the MLP."""
    from fm_parallel.trainer.model import hidden

    model = _model(tile=50, attention_chunk=100, layers=3, checkpointing=False)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = hidden(model, torch.randint(0, 258, (1, N)), torch.arange(N).view(1, N), masks.document([100, 120, 80]), None, "auto")
    h.sum().backward()  # and it trains: every LoRA weight gets a gradient
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    big = [b for b in seen.values() if b >= N * 32 * 8 // 4]
    assert sum(big) == 4 * N * 32 * 8, [b / (N * 32 * 8) for b in big]  # 3 layer inputs + the final norm's input


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_compiled_parts_give_the_untiled_loss_and_gradients():
    """model.compile = on: the per-token parts through torch.compile (the GPU default), one compiled
    function per part shared by both layers, full tiles and shorter ones (the length made dynamic)."""
    import torch._dynamo

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    from fm_parallel.longcontext.tiling import _compiled

    mask = masks.document([100, 120, 80])
    for chunk in (128, 0):  # attention per query chunk, and over the whole sequence (the CP / baselines path)
        want = _step(_model(checkpointing=False, layers=2), mask)
        _same(_step(_model(tile=64, attention_chunk=chunk, layers=2, compile="on"), mask), want)
    assert _compiled.cache_info().currsize == 3  # query, keys, output: one each, for every layer
    # Other documents, so other chunk cuts and tile lengths: no new graph (a graph per tile length
    # passed Dynamo's recompile limit on the first GPU run and fell back to eager for the rest).
    graphs = counters["stats"]["unique_graphs"]
    other = masks.document([37, 150, 113])
    _same(_step(_model(tile=50, attention_chunk=90, layers=2, compile="on"), other),
          _step(_model(checkpointing=False, layers=2), other))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_failed_compile_names_the_key_that_turns_it_off(monkeypatch):
    import torch._dynamo

    from fm_parallel.longcontext import tiling

    def failing(fn, **kwargs):
        def run(*args, **kw):
            raise torch._dynamo.exc.Unsupported("a layer Dynamo cannot trace")
        return run

    tiling._compiled.cache_clear()
    monkeypatch.setattr(torch, "compile", failing)
    try:
        model = _model(tile=64, attention_chunk=128, layers=1, compile="on")
        with pytest.raises(RuntimeError, match=r"model.compile: torch.compile failed on the tiled layers' \w+ part "
                                               r"\(Unsupported: a layer Dynamo cannot trace\); set model.compile = 'off'"):
            _step(model, masks.document([100, 120, 80]))
    finally:
        tiling._compiled.cache_clear()


def test_compile_on_needs_tiled_layers():
    from fm_parallel.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.compile: expected model.tile_chunk > 0 with compile on"):
        load_config(["--model.compile", "on"], environ={})
    with pytest.raises(ConfigError, match=r"model.compile: expected auto, on or off, got .yes."):
        load_config(["--model.compile", "yes"], environ={})


def test_dropout_in_a_tiled_layer_is_refused():
    model = _model(tile=50)
    model.get_base_model().model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"model.tile_chunk: expected no dropout in a tiled decoder layer"):
        _step(model, masks.causal(N))


def test_attention_chunk_is_validated():
    from fm_parallel.trainer.config import load_config
    from fm_parallel.longcontext.tiling import tile_decoder_layers

    with pytest.raises(ValueError, match=r"attention_chunk: expected a value >= 0"):
        load_config(["--model.attention_chunk", "-1"], environ={})
    with pytest.raises(ValueError, match=r"attention_chunk: expected a number of query rows >= 0 \(0: the whole sequence\), got -3"):
        tile_decoder_layers(_model(), 16, -3)
    assert math.isfinite(1.0)
