"""Ranks that disagree, fail alone or die: every live rank raises the same clear error, never a hang,
never a silently wrong result.

The agreement digest is a real hash: packings that the old weighted-sum digest could not tell apart
(``document([2, 30, 32])`` and ``document([9, 44, 11])``) are told apart by ring, Ulysses and hybrid.

The disagreements that leave every rank alive run in one spawn per world size (module fixtures), each
test reading its own case; a rank that dies or stalls gets a spawn of its own.
"""

import itertools
import time

import pytest
import torch

from tests.distributed.spawn import run_cases, run_ranks

N, H, D = 64, 4, 8


def _qkv(rank, world, dtype=torch.float32, n_local=None):
    torch.manual_seed(rank)
    n_local = N // world if n_local is None else n_local
    return [torch.randn(1, H, n_local, D, dtype=dtype) for _ in range(3)]


def _call(kind, q, k, v, mask, plan, world):
    from fm_parallel.distributed import hybrid_attention, ring_attention, ulysses_attention

    if kind == "ring":
        return ring_attention(q, k, v, mask, plan)
    if kind == "ulysses":
        return ulysses_attention(q, k, v, mask, plan)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
    return hybrid_attention(q, k, v, mask, plan, mesh)


def _outcome(fn):
    try:
        fn()
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic()}


def disagreeing_masks(rank, world, kind):
    from fm_parallel import masks
    from fm_parallel.distributed import shard

    mask = masks.document([2, 30, 32]) if rank == 0 else masks.document([9, 44, 11])
    plan = shard(N, world, "contiguous")
    return _outcome(lambda: _call(kind, *_qkv(rank, world), mask, plan, world))


def disagreeing_dtypes(rank, world, kind):
    from fm_parallel import masks
    from fm_parallel.distributed import shard

    dtype = torch.float32 if rank == 0 else torch.float64
    return _outcome(lambda: _call(kind, *_qkv(rank, world, dtype), masks.causal(N), shard(N, world, "contiguous"), world))


def one_rank_fails_its_own_check(rank, world, kind):
    from fm_parallel import masks
    from fm_parallel.distributed import shard

    n_local = N // world + (1 if rank == world - 1 else 0)  # the last rank brings one token too many
    q, k, v = _qkv(rank, world, n_local=n_local)
    return _outcome(lambda: _call(kind, q, k, v, masks.causal(N), shard(N, world, "contiguous"), world))


DISAGREEMENTS = {2: [(fn, kind) for fn in (disagreeing_masks, disagreeing_dtypes, one_rank_fails_its_own_check)
                     for kind in ("ring", "ulysses")],
                 4: [(disagreeing_masks, "hybrid"), (one_rank_fails_its_own_check, "hybrid")]}


def _disagreements(world):
    return run_cases(world, {f"{fn.__name__}/{kind}": (fn, (kind,)) for fn, kind in DISAGREEMENTS[world]}, timeout=300)


@pytest.fixture(scope="module")
def two_ranks():
    return _disagreements(2)


@pytest.fixture(scope="module")
def four_ranks():
    return _disagreements(4)


def _results(request, fn, kind, world):
    return request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")[f"{fn.__name__}/{kind}"]


@pytest.mark.parametrize("kind, world", [("ring", 2), ("ulysses", 2), ("hybrid", 4)])
def test_masks_that_a_weak_digest_confused_are_refused_on_every_rank(kind, world, request):
    from fm_parallel import masks

    a, b = masks.document([2, 30, 32]), masks.document([9, 44, 11])
    assert not torch.equal(a.to_dense(), b.to_dense())
    results = _results(request, disagreeing_masks, kind, world)
    # Hybrid agrees over the Ulysses groups then the ring groups: every rank of the grid learns it.
    assert all("ValueError: mask: expected the same value on every rank" in r["error"] for r in results), results


@pytest.mark.parametrize("kind, world", [("ring", 2), ("ulysses", 2)])
def test_ranks_with_different_dtypes_raise_instead_of_crashing_gloo(kind, world, request):
    results = _results(request, disagreeing_dtypes, kind, world)
    want = "ValueError: dtype: expected the same value on every rank, got ['float32', 'float64'] (by rank)"
    assert all(r["error"] == want for r in results), results


@pytest.mark.parametrize("kind, world", [("ring", 2), ("ulysses", 2), ("hybrid", 4)])
def test_a_rank_failing_its_own_check_still_joins_so_all_raise_the_same_error(kind, world, request):
    results = _results(request, one_rank_fails_its_own_check, kind, world)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, results
    assert errors.pop().startswith(f"ValueError: rank {world - 1}: q, k, v: expected {N // world} local tokens")


def absent_peer(rank, world, behaviour):
    from fm_parallel import masks
    from fm_parallel.distributed import comm, ring_attention, shard

    comm.AGREEMENT_TIMEOUT_S = 3.0
    if rank == 1:
        if behaviour == "dies":
            import os

            os._exit(0)  # gone without a word: its sockets close
        time.sleep(8)  # alive but elsewhere, then killed: never reaches the call
        import os

        os._exit(0)
    start = time.monotonic()
    result = _outcome(lambda: ring_attention(*_qkv(rank, world), masks.causal(N), shard(N, world, "contiguous")))
    result["seconds"] = time.monotonic() - start
    return result


@pytest.mark.parametrize("behaviour", ["stuck", "dies"])
def test_a_dead_or_absent_rank_gives_a_clear_error_not_a_hang(behaviour):
    results = run_ranks(absent_peer, 2, behaviour, timeout=120, allow_missing=True)
    first = results[0]
    assert first is not None and first["error"].startswith("RankFailure: ranks' agreement check: a peer did not answer"), results
    assert first["seconds"] < 10, first


def test_the_digest_tells_every_three_document_packing_apart():
    from fm_parallel import masks
    from fm_parallel.distributed import shard

    digests = {}
    for a, b in itertools.combinations(range(1, N), 2):
        lengths = (a, b - a, N - b)
        digests.setdefault(masks.document(list(lengths)).digest(), []).append(lengths)
    assert len(digests) == len(list(itertools.combinations(range(1, N), 2)))  # 1953 packings, 1953 digests
    # Carried to another device and back without recomputing; changes with num_rows and shape.
    m = masks.document([2, 30, 32])
    assert m.to("meta").digest() == m.digest() if hasattr(torch, "meta") else True
    assert masks.full(8).digest() != masks.full(8, num_rows=9).digest()
    assert shard(N, 2, "contiguous").digest() != shard(N, 2, "zigzag").digest()


def stalls_after_agreement(rank, world):
    import os

    from fm_parallel import masks
    from fm_parallel.distributed import comm, ring_attention, shard

    comm.AGREEMENT_TIMEOUT_S = 3.0
    if rank == 1:  # agrees, then never posts a transfer (stuck, then killed)
        def stuck(self, sends, recvs):
            time.sleep(8)
            os._exit(0)

        comm.RingComm.exchange = stuck
    start = time.monotonic()
    result = _outcome(lambda: ring_attention(*_qkv(rank, world), masks.causal(N), shard(N, world, "contiguous")))
    result["seconds"] = time.monotonic() - start
    return result


def test_a_rank_that_stops_inside_the_ring_gives_a_clear_error_not_a_hang():
    results = run_ranks(stalls_after_agreement, 2, timeout=120, allow_missing=True)
    first = results[0]
    assert first is not None and first["error"].startswith("RankFailure: context-parallel transfer: a peer did not answer"), results
    assert first["seconds"] < 10, first


def test_the_ring_kernel_name_follows_flashmask_attentions_device_rule(monkeypatch):
    """One resolver (fm_parallel.backends) for every entry point: Triton on CPU tensors only under the
    interpreter (TRITON_INTERPRET=1, not merely set), CuTe never; None is auto."""
    from fm_parallel import backends

    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in ("triton", "cute"):
        with pytest.raises(ValueError, match=f"impl: '{name}' needs CUDA tensors"):
            backends.resolve(name, cpu, chunked=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.resolve("triton", cpu, chunked=True) == "triton"
    with pytest.raises(ValueError, match="impl: 'cute' needs CUDA tensors"):
        backends.resolve("cute", cpu, chunked=True)
    assert backends.resolve(None, cpu, chunked=True) == backends.resolve("auto", cpu, chunked=True) == "torch"


def test_finished_gloo_works_are_held_by_python():
    """The works an agreement waited for stay referenced from Python (comm.hold_works): otherwise the
    gloo worker thread may drop the last reference and free their tensors at the interpreter's exit,
    a SIGABRT ('terminate called without an active exception') after the job's work is done."""
    import torch.distributed as dist

    from fm_parallel.distributed import comm

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm._HELD_WORKS.clear()
        comm.check_agreement([1, 2], ["a", "b"])
        held = [w for works in comm._HELD_WORKS for w in works]
        assert held and all(isinstance(w, dist.Work) for w in held)
        assert all(w.is_completed() for w in held)
    finally:
        if started:
            dist.destroy_process_group()


_EXIT_SCRIPT = """
import os, sys, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    from fm_parallel import masks
    from fm_parallel.distributed import prepare, shard
    mask = masks.document([16, 32, 16])
    prepared = prepare(mask, shard(mask, 2, "zigzag"))
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    for _ in range(20):
        prepared.agree(q, k, v, None)  # the last collective before the exit, as in every layer call
    dist.destroy_process_group()

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "init"),), nprocs=2, start_method="spawn")
"""


def test_ranks_whose_last_collective_is_an_agreement_exit_cleanly(tmp_path):
    """Before the works were held, 6 of 30 runs of this script aborted a rank at exit (SIGABRT)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_after_agreement.py"
    script.write_text(_EXIT_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(__import__("os").environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=root)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-2000:]
