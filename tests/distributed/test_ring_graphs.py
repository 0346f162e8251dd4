"""The ring's layers captured as CUDA graphs (fm_parallel/distributed/graphs.py): refused with a named
error wherever they cannot run (CPU, gloo, Ulysses / hybrid, ranks that disagree: every rank raises,
none hangs), and on a GPU the same results as the eager ring, layer after layer with new values.

The GPU half runs one rank of the ring in one process over a stand-in transport that CUDA graphs
can capture (a device copy per received chunk, like ``launch/bench/cp_layer_cost.py``): the
kernels, windows, merges, sums and their order are the real ring's; NCCL itself is not run here."""

import math

import pytest
import torch

from tests.distributed.spawn import run_cases

GPU = torch.cuda.is_available()


def test_cuda_graphs_refused_off_cuda_and_for_bad_values():
    from fm_parallel import masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel
    from fm_parallel.distributed.prepared import PreparedMask

    mask = masks.causal(64)
    plan = shard(mask, 2, "zigzag")
    with pytest.raises(ValueError, match="cuda_graphs: expected q / k / v on a CUDA device"):
        PreparedMask(mask, plan, 0, torch.device("cpu"), cuda_graphs=True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="cuda_graphs: expected a bool"):
            PreparedMask(mask, plan, 0, torch.device("cpu"), cuda_graphs=bad)
        with pytest.raises(ValueError, match="cuda_graphs: expected a bool"):
            ContextParallel("ring", plan, cuda_graphs=bad)
    for mode in ("ulysses", "hybrid"):
        with pytest.raises(ValueError, match="cuda_graphs: expected mode='ring'"):
            ContextParallel(mode, plan, mesh=object(), cuda_graphs=True)
    assert PreparedMask(mask, plan, 0, torch.device("cpu")).graphs is None


def test_trainer_config_refuses_cuda_graphs_without_the_ring():
    from fm_parallel.trainer.config import ConfigError, load_config

    assert load_config(["--parallel.cuda_graphs", "true"], environ={}).parallel.cuda_graphs is True
    for cp in ("ulysses", "hybrid", "none"):
        with pytest.raises(ConfigError, match="parallel.cuda_graphs: expected parallel.cp ring"):
            load_config(["--parallel.cuda_graphs", "true", "--parallel.cp", cp], environ={})
    with pytest.raises(ConfigError, match="parallel.cuda_graphs: expected a boolean"):
        load_config(["--parallel.cuda_graphs", "maybe"], environ={})


def test_ring_refuses_graphs_over_a_transport_it_cannot_capture():
    from fm_parallel import backends, masks
    from fm_parallel.distributed import RingStats, shard
    from fm_parallel.distributed.prepared import PreparedMask
    from fm_parallel.distributed.ring import _Ring

    mask = masks.causal(64)
    prepared = PreparedMask(mask, shard(mask, 2, "zigzag"), 0, torch.device("cpu"))
    prepared.graphs = object()  # as if prepared for graphs (a CPU test cannot make a CUDA one)

    class HostComm:  # no `capturable`: like gloo's host-staged transfers
        rank, world_size = 0, 2

    with pytest.raises(ValueError, match="cuda_graphs: expected a transport CUDA graphs can capture"):
        _Ring(prepared, HostComm(), 0.125, backends.get("torch"), RingStats())


def graphs_over_gloo(rank, world, disagree):
    """prepare(..., cuda_graphs=True) on gloo ranks: refused on every rank, or (``disagree``) rank 0
    alone asks for graphs and every rank raises the same named error instead of hanging."""
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, shard

    mask = masks.causal(64)
    plan = shard(mask, world, "zigzag")
    try:
        prepare(mask, plan, cuda_graphs=(rank == 0) if disagree else True)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.fixture(scope="module")
def over_gloo():
    """Both cases in one 2-rank spawn."""
    return run_cases(2, {str(disagree): (graphs_over_gloo, (disagree,)) for disagree in (False, True)}, timeout=180)


@pytest.mark.parametrize("disagree", [False, True])
def test_prepare_with_graphs_over_gloo_fails_on_every_rank(over_gloo, disagree):
    results = over_gloo[str(disagree)]
    for res in results:
        assert "exception" not in res, res.get("traceback")
        assert res["error"] is not None and "cuda_graphs: expected" in res["error"], res
    if not disagree:  # CPU tensors here; on CUDA tensors over gloo the message asks for NCCL
        assert all("CUDA device" in res["error"] for res in results)


# ----------------------------------------------------------------------------------------- GPU


class Loopback:
    """Rank ``rank`` of ``world`` in one process, a transport CUDA graphs can capture: a receive is a
    device copy of the peer's key window (forward) or of a same-shaped slice (gradients)."""

    capturable = True

    def __init__(self, rank, world, chunks, prepared):
        self.rank, self.world_size, self.chunks, self.prepared = rank, world, chunks, prepared

    def send_to(self, step):
        return (self.rank + step) % self.world_size

    def recv_from(self, step):
        return (self.rank - step) % self.world_size

    def exchange(self, sends, recvs):
        for i, (buf, peer) in enumerate(recvs):
            c0, _ = self.prepared.key_window(peer)
            source = self.chunks[peer][i % 2]
            c0 = min(c0, source.shape[2] - buf.shape[2])
            buf.copy_(source[:, :, c0:c0 + buf.shape[2]])
        return None

    def wait(self, pending):
        return None


def _layers(impl, mask_name, graphs, layers, rank=1, world=4, n=4096, hq=4, hkv=2, d=128):
    """``layers`` forward + backward layers of one rank on one prepared mask, each on new values;
    returns per layer (out, dq, dk, dv, stats) and the prepared mask."""
    from fm_parallel import backends, flashmask_attention, masks
    from fm_parallel.distributed import RingStats, shard
    from fm_parallel.distributed.prepared import PreparedMask
    from fm_parallel.distributed.ring import _Ring, _RingAttention

    family = {"docs": masks.document([1000, 600, 1500, 996]),
              "sliding_sinks": masks.sliding_window(n, 512, sinks=8),
              "dpo": masks.dpo(n // 2, n // 4, n // 4)}[mask_name]
    plan = shard(family, world, "zigzag")
    device = torch.device("cuda")
    prepared = PreparedMask(family.to(device), plan, rank, device, host_mask=family, cuda_graphs=graphs)
    backend = backends.get(backends.resolve(impl, device, torch.bfloat16, d, chunked=True))
    # The peers' K / V live at fixed addresses, as NCCL's receive buffers would inside the graph: each
    # layer writes its values into them (a captured copy reads the memory it was captured with).
    peers = [(torch.empty(1, hkv, n // world, d, device=device, dtype=torch.bfloat16),
              torch.empty(1, hkv, n // world, d, device=device, dtype=torch.bfloat16)) for _ in range(world)]
    comm = Loopback(rank, world, peers, prepared)
    results = []
    for layer in range(layers):
        gen = torch.Generator(device="cuda").manual_seed(layer)
        q, k, v, dout = (torch.randn(1, h, n, d, device=device, dtype=torch.bfloat16, generator=gen)
                         for h in (hq, hkv, hkv, hq))
        for r, (pk, pv) in enumerate(peers):
            pk.copy_(plan.shard(k, r, 2))
            pv.copy_(plan.shard(v, r, 2))
        ql = plan.shard(q, rank, 2).clone().requires_grad_()
        kl, vl = (t.clone().requires_grad_() for t in peers[rank])
        stats = RingStats()
        ring = _Ring(prepared, comm, 1.0 / math.sqrt(d), backend, stats)
        out = _RingAttention.apply(ql, kl, vl, ring)
        out.backward(plan.shard(dout, rank, 2))
        with torch.no_grad():  # this rank's rows of one GPU's output (the forward receives real K / V)
            reference = plan.shard(flashmask_attention(q, k, v, mask=prepared.mask, impl=impl), rank, 2)
        results.append((out.detach(), ql.grad, kl.grad, vl.grad, stats, reference))
    torch.cuda.synchronize()
    return results, prepared


def _impls():
    from fm_parallel import backends

    names = ["triton"]
    try:
        if backends.get("cute").unsupported(torch.device("cuda"), torch.bfloat16, 128) is None:
            names.append("cute")
    except ValueError:  # FA4 not installed: Triton only
        pass
    return names


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mask_name", ["docs", "sliding_sinks", "dpo"])
@pytest.mark.parametrize("rank", [0, 1])
def test_graphed_ring_matches_the_eager_ring_layer_after_layer(mask_name, rank):
    """Layer 1 eager, layer 2 captured and replayed, layers 3-4 replayed, each on new values: out,
    dQ, dK, dV and the transfer counts equal the eager ring's on the same values (the forward
    exactly; the backward within bf16 rounding, FA4's dQ accumulates with atomics), and the output
    is this rank's rows of one GPU's."""
    for impl in _impls():
        eager, _ = _layers(impl, mask_name, False, 4, rank=rank)
        graphed, prepared = _layers(impl, mask_name, True, 4, rank=rank)
        assert prepared.graphs.counters == {"eager": 2, "captures": 2, "replays": 6, "failed": 0}, (impl, prepared.graphs.counters)
        for layer, (a, b) in enumerate(zip(eager, graphed)):
            for name, x, y in zip(("out", "dq", "dk", "dv"), a[:4], b[:4]):
                scale = x.float().abs().max().item()
                err = (x.float() - y.float()).abs().max().item()
                tol = 0.0 if (name == "out" or impl == "triton") else 2e-2 * scale
                assert err <= tol, f"{impl} {mask_name} rank {rank} layer {layer} {name}: {err} > {tol}"
            assert a[4] == b[4], (impl, layer, a[4], b[4])
            err = (b[0].float() - b[5].float()).abs().max().item()
            assert err <= 2e-2 * b[5].float().abs().max().item(), f"{impl} {mask_name} rank {rank} layer {layer}: out vs one GPU {err}"
        # Not stale: consecutive layers (new values) give different outputs.
        assert not torch.equal(graphed[2][0], graphed[3][0])


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_a_new_step_captures_again_with_the_same_results():
    """A new prepared mask (the next step) runs its first layer eagerly and captures its own graphs;
    on the same values it gives the same results (Triton's kernels are deterministic)."""
    first, _ = _layers("triton", "docs", True, 3)
    second, prepared = _layers("triton", "docs", True, 3)
    assert prepared.graphs.counters == {"eager": 2, "captures": 2, "replays": 4, "failed": 0}
    for a, b in zip(first, second):
        for x, y in zip(a[:4], b[:4]):
            assert torch.equal(x, y)


def test_context_parallel_says_when_a_given_prepared_mask_has_no_graphs(caplog):
    """ContextParallel(cuda_graphs=True) handed a PreparedMask made without graphs runs it eagerly and
    says so on the fm_parallel logger (not silently; not an error one rank alone would raise)."""
    import logging

    from fm_parallel import backends, masks
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel
    from fm_parallel.distributed.prepared import PreparedMask

    mask = masks.causal(64)
    plan = shard(mask, 2, "zigzag")
    prepared = PreparedMask(mask, plan, 0, torch.device("cpu"))
    ctx = ContextParallel("ring", plan, cuda_graphs=True)
    backends._logged.discard("context-graphs-unprepared")
    with caplog.at_level(logging.WARNING, logger="fm_parallel"):
        assert ctx._prepared(None, None, None, prepared) is prepared
    assert "made without cuda_graphs" in caplog.text
