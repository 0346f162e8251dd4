"""No silent fallback: every kernel name through every entry point either runs the backend the one
resolver (fm_parallel.backends.resolve) names for it, or raises the resolver's ValueError.

Entry points: flashmask_attention, ring_attention, ulysses_attention, hybrid_attention,
ContextParallel (what the Hugging Face backend and the trainer call under CP), the Hugging Face
backend without CP (``fm_impl``), the DeepSpeed plugin, and the trainer's ``parallel.impl`` key. A
spy on the backends records which one ran. (Once, ``ring_attention(impl="auto")`` ran the PyTorch path
on a GPU; an unknown name ran it too.)
"""

import re

import pytest
import torch

from tests.distributed.spawn import run_ranks

N, HQ, HKV, D = 64, 4, 2, 8
NAMES = [None, "auto", "torch", "triton", "cute", "dense", "bogus", "Triton", ""]


def _spy(monkeypatch=None):
    """Record the name of every backend that runs (launchers, differentiable calls, the dense path).
    In the test process pass ``monkeypatch`` (the spies are undone afterwards); spawned ranks keep them."""
    from fm_parallel import backends

    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    ran = []
    for method in ("forward", "backward", "attention"):
        real = getattr(backends.Backend, method)

        def spied(self, *a, _real=real, **kw):
            ran.append(self.name)
            return _real(self, *a, **kw)

        setattr_(backends.Backend, method, spied)  # every backend, dense included, runs through these
    return ran


def _expected(name, chunked, dtype=torch.float32, head_dim=D):
    from fm_parallel import backends

    try:
        return backends.resolve(name, torch.device("cpu"), dtype, head_dim, head_dim, chunked=chunked)
    except ValueError as e:
        return f"ValueError: {e}"


def _run(ran, call):
    ran.clear()
    try:
        out = call()
        out.float().sum().backward()
    except ValueError as e:  # a CP call raises through the agreement, naming the first rank that failed
        return f"ValueError: {re.sub(r'^rank [0-9]+: ', '', str(e))}"
    used = sorted(set(ran))
    return used[0] if len(used) == 1 else f"several: {used}"


def every_name_everywhere(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fm_parallel import flashmask_attention, masks
    from fm_parallel.distributed import hybrid_attention, ring_attention, shard, ulysses_attention
    from fm_parallel.distributed.context import ContextParallel

    ran = _spy()
    mask = masks.document([20, 30, 14])
    plan = shard(mask, world, "zigzag")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses"))

    def local():
        torch.manual_seed(rank)
        return [torch.randn(1, h, N // world, D, requires_grad=True) for h in (HQ, HKV, HKV)]

    entries = {
        "ring": (True, lambda impl: ring_attention(*local(), mask, plan, impl=impl)),
        "ulysses": (False, lambda impl: ulysses_attention(*local(), mask, plan, impl=impl)),
        "hybrid": (True, lambda impl: hybrid_attention(*local(), mask, plan, mesh, impl=impl)),
        "context:ring": (True, lambda impl: ContextParallel("ring", plan, impl=impl).attention(*local(), mask)),
        "context:ulysses": (False, lambda impl: ContextParallel("ulysses", plan, impl=impl).attention(*local(), mask)),
        "context:hybrid": (True, lambda impl: ContextParallel("hybrid", plan, mesh=mesh, impl=impl).attention(*local(), mask)),
        "flashmask_attention": (False, lambda impl: flashmask_attention(
            *(torch.randn(1, h, N, D, requires_grad=True) for h in (HQ, HKV, HKV)), mask=mask, impl=impl)),
    }
    results = {}
    for entry, (chunked, call) in entries.items():
        for impl in NAMES:
            results[f"{entry}:{impl}"] = {"got": _run(ran, lambda: call(impl)), "want": _expected(impl, chunked)}
    return results


def test_every_name_through_every_distributed_entry_point_runs_what_the_resolver_says():
    results = run_ranks(every_name_everywhere, 4, timeout=400)
    for res in results:
        assert "exception" not in res, res.get("traceback")
    assert results[0] == results[1] == results[2] == results[3]
    for key, r in results[0].items():
        assert r["got"] == r["want"], (key, r)
    # What the resolver says here (CPU, the Triton interpreter on): each name once, for the record.
    ring = {k.split(":")[-1]: v["want"] for k, v in results[0].items() if k.startswith("ring:")}
    assert ring["None"] == ring["auto"] == ring["torch"] == "torch" and ring["triton"] == "triton"
    assert ring["cute"].startswith("ValueError: impl: 'cute' needs CUDA tensors")
    assert ring["dense"].startswith("ValueError: impl: 'dense' runs only where the whole mask is local")
    for bad in ("bogus", "Triton", ""):
        assert ring[bad].startswith("ValueError: impl: expected one of"), ring[bad]


def test_every_name_through_the_hugging_face_and_deepspeed_backends(monkeypatch):
    from fm_parallel import masks
    from fm_parallel.integrations import transformers as fm_hf
    from fm_parallel.integrations.deepspeed import FlashMaskLocalAttention
    from tests.helpers import tiny_llama

    ran = _spy(monkeypatch)
    model = tiny_llama(fm_hf.register()).eval()
    ids = torch.randint(0, 100, (1, 24))
    mask = masks.document([10, 14])
    q, k, v = (torch.randn(1, 24, h, D, requires_grad=True) for h in (HQ, HKV, HKV))  # DeepSpeed's [B, S, H, D]
    for impl in NAMES:
        want = _expected(impl, chunked=False, dtype=torch.float64, head_dim=64 // 4)  # the tiny model: float64, D 16
        got = _run(ran, lambda: model(ids, flashmask=mask, fm_impl=impl).logits)
        assert got == want, ("hf", impl, got, want)
        want = _expected(impl, chunked=False)
        got = _run(ran, lambda: FlashMaskLocalAttention(mask, impl=impl)(q, k, v))
        assert got == want, ("deepspeed", impl, got, want)


def test_the_trainer_accepts_exactly_the_resolvers_chunked_names():
    from fm_parallel import backends
    from fm_parallel.trainer.config import ConfigError, load_config

    for name in backends.names():
        chunked_ok = name == "auto" or backends.get(name).chunked
        try:
            cfg = load_config([f"--parallel.impl={name}"], environ={})
            assert chunked_ok and cfg.parallel.impl == name
        except ConfigError as e:
            assert not chunked_ok and "parallel.impl" in str(e), (name, e)
    with pytest.raises(ConfigError, match="parallel.impl"):
        load_config(["--parallel.impl=bogus"], environ={})
