"""The run's memory plan (model.memory_plan = "auto", fm_parallel/trainer/capacity.py) and the step's
FLOPs (fm_parallel/trainer/flops.py). The GPU measurement is replaced by a stated one here (the CPU has
no allocator statistics); the plan's choices, the refusal before the model is built, and the
trainer's handling are what is tested."""

import pytest
import torch

from fm_parallel.longcontext.memory import GIB

pytest.importorskip("transformers")

KIB = 2**10


def _cfg(*argv):
    from fm_parallel.trainer.config import load_config

    return load_config(["--model.hidden_size", "4096", "--model.layers", "32", "--model.heads", "32", "--model.kv_heads", "8",
                        "--model.intermediate_size", "14336", "--model.tile_chunk", "16384", "--model.memory_plan", "auto",
                        "--parallel.cp", "none", *argv], environ={})


def _measured(per_token_kib: float, fixed_gib: float = 3.0, loss_gib: float = 0.0):
    """A stated one-layer measurement: the 8B shape's one-layer model (embedding, head, one layer). The
    layers' backward grows ``per_token_kib`` per token over ``fixed_gib``; the loss's backward is a
    constant ``loss_gib`` (its chunks over the vocabulary)."""
    layer = 218_103_808 * 2  # the layer's bf16 parameters
    adapter = 4 * 2 * 16 * (4096 + 4096) * 4  # LoRA r16 on q/k/v/o (fp32), roughly

    def measure(cfg, device, vocab, lengths):
        measure.lengths = lengths
        return {"static": 2.1 * GIB, "layer": layer, "adapter": adapter,
                "peaks": {n: {"forward": 1 * GIB, "loss_backward": loss_gib * GIB,
                              "layers_backward": fixed_gib * GIB + per_token_kib * KIB * n} for n in lengths}}

    return measure


class _Device:
    type = "cuda"


def _gpu(monkeypatch, total_gib: float, elsewhere_gib: float = 0.0, reserved_gib: float = 0.0, set_attr=None):
    """torch.cuda's memory for a stated device: this process's allocator holds ``reserved_gib`` and its CUDA
    context 0.6 GiB; other processes ``elsewhere_gib``. ``set_attr``: ``setattr`` in a spawned rank (no
    monkeypatch there), else ``monkeypatch.setattr``."""
    total = total_gib * GIB
    free = total - (0.6 + elsewhere_gib + reserved_gib) * GIB
    set_attr = set_attr or monkeypatch.setattr
    set_attr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": total})())
    set_attr(torch.cuda, "mem_get_info", lambda d=None: (free, total))
    set_attr(torch.cuda, "memory_reserved", lambda d=None: reserved_gib * GIB)


@pytest.fixture
def h200(monkeypatch):
    """torch.cuda's memory for a stated 139 GiB device, this process's alone."""
    _gpu(monkeypatch, 139)


@pytest.mark.parametrize("n, every, offload", [(262144, 1, 0), (524288, 1, 9), (1048576, 2, 16)])
def test_the_plan_at_each_length_asked_directly(h200, n, every, offload):
    """40 KiB per token, the margin's 1 and 17.8 GiB of constants (weights, adapters, the one-layer
    model's fixed part), the layers' backward holding the kept checkpoints below the layer it is in:
    256k needs no host copy; 512k 9 layers' checkpoints on the host (4 GiB each; 17.8 + 20.5 + 22 x 4
    of 130.7 GiB); at 1M a checkpoint per layer cannot fit (256 GiB of them), every 2 layers with 8 of
    16 on the host can (17.8 + 41 + 8 x 8: the last segment holds the 7 kept below it and its other
    input)."""
    from fm_parallel.trainer.capacity import plan_run

    cfg = _cfg("--data.seq_len", str(n), "--model.host_memory_gib", "100")
    said = []
    plan = plan_run(cfg, _Device(), 128256, measure=_measured(40), say=said.append)
    assert (plan.every, plan.offload_layers) == (every, offload)
    assert (cfg.model.checkpoint_every, cfg.model.offload_layers) == (every, offload)
    assert plan.device_bytes <= 0.94 * 139 * GIB and plan.host_bytes <= 100 * GIB
    assert len(said) == 1 and said[0].startswith(f"memory plan: {n} tokens:")


def test_the_device_budget_leaves_out_what_other_processes_hold(monkeypatch):
    """94% of the GPU on a GPU this process has to itself, whatever its own allocator holds; less what
    other processes hold (beyond this process's context), said once."""
    from fm_parallel.longcontext.memory import CONTEXT_BYTES, gpu_memory_budget

    _gpu(monkeypatch, 139, reserved_gib=30)
    assert gpu_memory_budget("cuda", 0.94) == (0.94 * 139 * GIB, 0.0)
    _gpu(monkeypatch, 139, elsewhere_gib=0.5, reserved_gib=30)  # within the context estimate's error
    assert gpu_memory_budget("cuda", 0.94) == (0.94 * 139 * GIB, 0.0)
    _gpu(monkeypatch, 139, elsewhere_gib=60, reserved_gib=30)
    budget, elsewhere = gpu_memory_budget("cuda", 0.94)
    assert elsewhere == pytest.approx(60.6 * GIB - CONTEXT_BYTES) and budget == pytest.approx(0.94 * 139 * GIB - elsewhere)


def test_the_plan_keeps_within_what_other_processes_leave(monkeypatch):
    """512k on a 139 GiB GPU where another process holds 60 GiB: the plan the whole GPU gives (9 layers
    offloaded, test above) would run out of memory; the plan keeps under what is left, and says why."""
    from fm_parallel.trainer.capacity import plan_run

    plans, said = {}, {}
    for elsewhere in (0, 60):
        _gpu(monkeypatch, 139, elsewhere_gib=elsewhere)
        cfg = _cfg("--data.seq_len", "524288", "--model.host_memory_gib", "100")
        said[elsewhere] = []
        plans[elsewhere] = plan_run(cfg, _Device(), 128256, measure=_measured(40), say=said[elsewhere].append)
    assert (plans[0].every, plans[0].offload_layers) == (1, 9) and len(said[0]) == 1
    shared = plans[60]
    assert shared.device_bytes <= (0.94 * 139 - 59.6) * GIB < plans[0].device_bytes
    assert (shared.every, shared.offload_layers) != (1, 9)
    assert said[60][0] == "memory plan: 59.6 GiB of this GPU is held outside this process's tensors (another process, " \
                          "or a library's own buffers); the plan keeps within the 71.1 GiB left (model.device_memory_gib sets it)"
    assert len(said[60]) == 2 and said[60][1].startswith("memory plan: 524288 tokens:")
    # a stated budget is the user's: nothing is said about other processes
    cfg = _cfg("--data.seq_len", "524288", "--model.host_memory_gib", "100", "--model.device_memory_gib", "130")
    stated = []
    assert plan_run(cfg, _Device(), 128256, measure=_measured(40), say=stated.append) == plans[0]
    assert len(stated) == 1


def test_the_plan_takes_the_phase_that_needs_the_most_at_the_length_asked(h200):
    """At the two short measured lengths the loss's backward (a large constant: its chunks over the
    vocabulary) peaks above the layers'; one line through the overall peaks would follow the loss and
    plan 1M too low. Each phase has its own line: at 1M the layers' backward needs the most, and the
    plan is the one a layers-only measurement gives; at 8k the loss's constant is what is planned."""
    from fm_parallel.trainer.capacity import plan_run

    plans, said = {}, []
    for name, measure in (("layers only", _measured(40)), ("with the loss", _measured(40, loss_gib=12.0))):
        cfg = _cfg("--data.seq_len", str(1 << 20), "--model.host_memory_gib", "100")
        plans[name] = plan_run(cfg, _Device(), 128256, measure=measure, say=said.append)
    assert measure.lengths == (131072, 262144)
    # the overall peaks at the measured lengths: 12 GiB then 13 GiB: the loss's, then the layers'
    assert plans["with the loss"] == plans["layers only"]
    assert "the layers backward peaks at this length: 40 KiB per token" in said[-1]
    short = {name: plan_run(_cfg("--data.seq_len", "8192"), _Device(), 128256, measure=measure, say=said.append)
             for name, measure in (("layers only", _measured(40)), ("with the loss", _measured(40, loss_gib=12.0)))}
    assert "the loss backward peaks at this length: 0 KiB per token" in said[-1]
    # 12 GiB for the loss beside the 32 kept checkpoints, against 3 GiB + 40 KiB x 8192 for the layers beside
    # the 31 below the last (to the byte, as planned bytes are int)
    ckpt = 8192 * 4096 * 2
    extra = short["with the loss"].device_bytes - short["layers only"].device_bytes
    assert abs(extra - (12 * GIB + 32 * ckpt - (3 * GIB + 40 * KIB * 8192 + 31 * ckpt))) <= 1


def test_a_length_that_cannot_fit_is_refused_naming_what_it_needs(h200):
    from fm_parallel.trainer.capacity import plan_run
    from fm_parallel.trainer.config import ConfigError

    cfg = _cfg("--data.seq_len", str(1 << 22), "--model.host_memory_gib", "100")
    with pytest.raises(ConfigError, match=r"data.seq_len: n: 4194304 tokens do not fit: the closest plan needs [\d.]+ GiB "
                                          r"on the device and [\d.]+ GiB of host memory, this machine gives 130.7 GiB and "
                                          r"100.0 GiB \(32 layers, a checkpoint of 32.00 GiB each; at its peak, the layers backward: 40 KiB "
                                          r"per token beyond the checkpoints and 1 KiB of margin, [\d.]+ GiB fixed\) \(model.memory_plan = 'auto', "
                                          r"measured on one layer at 131072 and 262144 tokens\)"):
        plan_run(cfg, _Device(), 128256, measure=_measured(40), say=lambda s: None)


def test_the_trainer_refuses_before_the_model_is_built(tmp_path, monkeypatch, h200):
    """Through train(): a length no plan fits is one ConfigError, and build_model is never called."""
    from fm_parallel.trainer import capacity, loop, parallel
    from fm_parallel.trainer.config import ConfigError, load_config

    monkeypatch.setattr(parallel, "device", lambda: _Device())
    monkeypatch.setattr(capacity, "measure_one_layer", _measured(400))
    monkeypatch.setattr(loop, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    cfg = load_config(["--model.memory_plan", "auto", "--data.seq_len", str(1 << 21), "--parallel.cp", "none",
                       "--output.dir", str(tmp_path / "run"), "--model.host_memory_gib", "10"], environ={})
    with pytest.raises(ConfigError, match=r"data.seq_len: n: 2097152 tokens do not fit"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("argv, documents", [
    (["--data.max_doc_tokens", "8192"], True),  # the 1M config: bounded documents, each chunk its own problem
    ([], False),  # unbounded documents: one may span the row
    (["--data.max_doc_tokens", "131072"], False),  # documents longer than a chunk: windows overlap
    (["--data.max_doc_tokens", "8192", "--data.objective", "dpo"], False),  # DPO samples are not bounded by it
])
def test_the_plan_measures_the_costliest_mask_the_data_can_give(argv, documents):
    """The one-layer measurement runs on the worst case of the run's data: with sft documents bounded
    by data.max_doc_tokens <= model.attention_chunk, documents of that length (every query chunk cut
    between them, no key windows overlapping), else one causal document."""
    from fm_parallel import masks
    from fm_parallel.masks.chunks import attention_chunks
    from fm_parallel.trainer.capacity import worst_case_mask

    n = 3 * 8192 * 4 + 100
    cfg = _cfg("--model.attention_chunk", "32768", *argv)
    mask = worst_case_mask(cfg, n)
    if not documents:
        assert torch.equal(mask.fms, masks.causal(n).fms) and torch.equal(mask.fme, masks.causal(n).fme)
        return
    lengths = [8192] * (n // 8192) + [n % 8192]
    want = masks.document(lengths)
    assert torch.equal(mask.fms, want.fms) and torch.equal(mask.fme, want.fme)
    chunks, overlap = attention_chunks(mask, 32768)
    assert not overlap and all((c.k0, c.k1) == (c.r0, c.r1) for c in chunks)
    # any packed row of such documents is no costlier: its chunks are cut between documents too
    _, packed_overlap = attention_chunks(masks.document(masks.sample_lengths(n, mean=4096)), 32768)
    assert not packed_overlap


def test_auto_on_the_cpu_says_it_cannot_measure_and_checkpoints_every_layer():
    from fm_parallel.trainer.capacity import plan_run

    cfg = _cfg("--model.offload_layers", "3")
    said = []
    assert plan_run(cfg, torch.device("cpu"), 258, say=said.append) is None
    assert (cfg.model.checkpoint_every, cfg.model.offload_layers) == (1, 0)
    assert said == ["memory plan: model.memory_plan = 'auto' measures on a GPU; on the CPU a checkpoint per layer, none offloaded"]


def test_memory_plan_is_validated():
    from fm_parallel.trainer.config import load_config

    with pytest.raises(ValueError, match=r"model.memory_plan: expected fixed or auto, got 'guess'"):
        load_config(["--model.memory_plan", "guess"], environ={})


def test_the_step_flops_of_the_8b_shape():
    from transformers import LlamaConfig

    from fm_parallel.trainer.flops import peak_tflops, step_flops

    c = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256)
    layer = 2 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336)  # forward FLOPs per token
    head = 2 * 4096 * 128256
    plain = step_flops(c, 1000, 0, tiled=False)
    assert plain.linear == 1000 * (32 * layer * 3 + head * 3) and plain.attention == 0
    tiled = step_flops(c, 1000, 5000, tiled=True)
    q_and_kv = 2 * (4096 * 4096 + 2 * 4096 * 1024)
    assert tiled.linear == 1000 * (32 * (q_and_kv * 4 + (layer - q_and_kv) * 3) + head * 3)
    assert tiled.attention == 32 * 32 * 4 * 128 * 5000 * 4.5  # forward, recomputed forward, backward (2.5x)
    assert step_flops(c, 1000, 0, tiled=True, checkpoint_every=2).linear == 1000 * (32 * (q_and_kv * 5 + (layer - q_and_kv) * 4) + head * 3)
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("a CPU") is None


def test_decoder_parameters_are_the_built_llamas_less_embeddings_and_head():
    """The count the CPU's host-memory check uses, against transformers' own Llama of that shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fm_parallel.longcontext.memory import decoder_parameters

    for shape in (dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
                  dict(hidden=96, layers=3, heads=6, kv_heads=6, intermediate=200)):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                                                 num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                                                 intermediate_size=shape["intermediate"]))
        outside = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
        assert decoder_parameters(**shape) == sum(p.numel() for p in model.parameters()) - outside
    assert round(decoder_parameters(4096, 32, 32, 8, 14336) / 1e9, 2) == 6.98  # the 8B shape less its embeddings


@pytest.mark.parametrize("argv, total_gib, message", [
    # the 8B shape at 1M on a 64 GiB host: 26 GiB of float32 weights, 32 checkpoints of 16 GiB
    ((), 64, r"^data.seq_len: 1048576 tokens on the CPU \(no GPU here\) need at least 538.0 GiB of host memory \(1 process "
             r"holding the decoder's 6.98 B parameters in float32, 26.0 GiB; 32 activation checkpoints of 1048576 x 4096 "
             r"float32, 512.0 GiB\), more than this host's 64.0 GiB: run it on a GPU, or with a shorter data.seq_len$"),
    (("--model.checkpoint_every", "4", "--model.memory_plan", "fixed"), 64, r"need at least 154.0 GiB .* 8 activation checkpoints"),
    (("--model.dtype", "bfloat16", "--data.seq_len", "4096"), 12, r"^model: 4096 tokens .* need at least 14.0 GiB .* in bfloat16, 13.0 GiB"),
    (("--data.seq_len", "4096"), 60, None),  # 28 GiB: fits
])
def test_a_cpu_run_beyond_the_hosts_memory_is_refused_naming_both(argv, total_gib, message):
    from fm_parallel.trainer.config import check_host_memory
    from fm_parallel.trainer.config import ConfigError

    cfg = _cfg("--data.seq_len", "1048576", *argv)
    if message is None:
        check_host_memory(cfg, total=total_gib * GIB)
        with pytest.raises(ConfigError, match=r"3 processes, each holding"):  # three local ranks: the weights thrice
            check_host_memory(cfg, local_processes=3, total=total_gib * GIB)
        return
    with pytest.raises(ConfigError, match=message):
        check_host_memory(cfg, total=total_gib * GIB)


def test_a_model_path_is_counted_from_its_config(tmp_path):
    import json

    from fm_parallel.trainer.config import check_host_memory
    from fm_parallel.trainer.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                                      "num_key_value_heads": 8, "intermediate_size": 14336}))
    cfg = _cfg("--model.path", str(tmp_path), "--data.seq_len", "8192")
    with pytest.raises(ConfigError, match=r"^model: .* 6.98 B parameters in float32"):
        check_host_memory(cfg, total=16 * GIB)
    check_host_memory(cfg, total=64 * GIB)
    check_host_memory(_cfg("--model.path", str(tmp_path / "missing")), total=GIB)  # the preflight names a bad folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's (a GPU run plans on the GPU)")
def test_the_1m_config_on_a_cpu_is_refused_at_once_through_the_launcher(tmp_path):
    """The documented GPU command run on a machine without one: one line naming what it needs, exit
    status 2, nothing written (it used to build the 8B model for minutes and die out of memory)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from fm_parallel.longcontext.memory import host_memory_bytes

    if host_memory_bytes() > 538 * GIB:
        pytest.skip("this host holds the 8B shape's 1M checkpoints")
    root = Path(__file__).resolve().parents[2]
    for nproc, need in (([], "538.0"), (["--nproc_per_node", "2"], "564.0")):  # 2 ranks: the weights twice
        proc = subprocess.run([sys.executable, "-m", "fm_parallel.launch", *nproc, "--config", "launch/configs/h200_8b_1m.toml",
                               "--output.dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=root)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        # model: where the weights alone are more than this host has; data.seq_len: where the checkpoints make it so
        assert re.search(r"^error: (model|data.seq_len): 1048576 tokens on the CPU \(no GPU here\) need at least " + need + " GiB",
                         proc.stderr, re.M), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
    # the README's form: torchrun starts the ranks, each counts the local processes (LOCAL_WORLD_SIZE) and refuses
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "launch/train.py",
                           "--config", "launch/configs/h200_8b_1m.toml", "--output.dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode != 0
    assert re.search(r"^error: (model|data.seq_len): 1048576 tokens on the CPU \(no GPU here\) need at least 564.0 GiB "
                     r"of host memory \(2 processes, each", proc.stdout + proc.stderr, re.M), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_every_rank_plans_under_the_smallest_budgets_of_any(monkeypatch, h200):
    """Ranks whose plans differ would recompute, and so call the ring, in different orders: each rank
    plans under the job's smallest device and host budgets (here another rank's GPU has 60 GiB held by
    another job), and the processes on one host share its memory (LOCAL_WORLD_SIZE)."""
    from fm_parallel.trainer import capacity
    from fm_parallel.trainer.capacity import plan_run
    from fm_parallel.trainer.config import ConfigError

    monkeypatch.setattr(capacity, "host_memory_bytes", lambda: 400 * GIB)
    alone = plan_run(_cfg("--data.seq_len", "1048576"), _Device(), 128256, measure=_measured(40), say=lambda s: None)
    budgets = []

    def agree(values):  # the element-wise maximum with another rank's values: 60 GiB of its GPU taken
        budgets.append(values)
        if len(values) == 3:  # (-device budget, -host budget, held elsewhere)
            return [max(values[0], -(0.94 * 139 - 59.6) * GIB), values[1], max(values[2], 59.6 * GIB)]
        return values

    said = []
    plan = plan_run(_cfg("--data.seq_len", "1048576"), _Device(), 128256, measure=_measured(40), agree=agree, say=said.append)
    assert budgets[-1] == [-0.94 * 139 * GIB, -300 * GIB, 0.0]  # this rank's own: 75% of 400 GiB, its GPU to itself
    assert plan.device_bytes <= (0.94 * 139 - 59.6) * GIB < alone.device_bytes
    assert said[0].startswith("memory plan: 59.6 GiB of this GPU is held outside this process's tensors")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a quarter of 75% of the host for each of 4 processes on it
    with pytest.raises(ConfigError, match=r"72.0 GiB of host memory, this machine gives 71.1 GiB and 75.0 GiB"):
        plan_run(_cfg("--data.seq_len", "1048576"), _Device(), 128256, measure=_measured(40), agree=agree, say=said.append)
    assert budgets[-1][1] == -75 * GIB


def _plan_on_a_rank(rank, world, elsewhere_gib):
    """One gloo rank's plan at 512k on a stated 139 GiB GPU, ``elsewhere_gib[rank]`` of it held by another
    process, the ranks agreeing through the trainer's own collective (no stand-in)."""
    from fm_parallel.trainer.capacity import plan_run

    _gpu(None, 139, elsewhere_gib=elsewhere_gib[rank], set_attr=setattr)
    said = []
    plan = plan_run(_cfg("--data.seq_len", "524288", "--model.host_memory_gib", "100"), _Device(), 128256,
                    measure=_measured(40), say=said.append)
    return {"plan": [plan.every, plan.offload_layers, plan.device_bytes], "said": said}


def test_ranks_agree_on_the_plan_through_their_collective():
    """Two gloo ranks, the second's GPU 60 GiB held by another job: both plan alike, under what the
    second has left, and both say why (the real all-reduce, as a multi-GPU run does it)."""
    from tests.distributed.spawn import run_ranks

    ranks = run_ranks(_plan_on_a_rank, 2, [0, 60], timeout=180)
    assert all("exception" not in r for r in ranks), ranks
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["plan"][2] <= (0.94 * 139 - 59.6) * GIB
    assert all(r["said"][0].startswith("memory plan: 59.6 GiB of this GPU is held outside this process's tensors") for r in ranks)
