"""The backend registry's public surface: names, get and the chunked resolver (the deprecated `launchers` view is gone)."""

import pytest
import torch

from fm_parallel import backends, masks
from tests.helpers import qkv


def test_names_and_get():
    assert backends.names() == ("auto", "cute", "triton", "torch", "dense")
    assert backends.get("torch").deterministic and not backends.get("cute").deterministic
    assert not backends.get("dense").chunked
    with pytest.raises(ValueError, match=r"impl: expected one of \('auto'"):
        backends.get("auto")  # a resolved name is expected


def test_the_chunked_resolver_and_launchers_are_the_registrys():
    """What the removed fm_parallel.launchers view offered, through the registry itself."""
    cpu = torch.device("cpu")
    assert tuple(n for n in backends.names() if n != "auto" and backends.get(n).chunked) == ("cute", "triton", "torch")
    with pytest.raises(ValueError, match="impl: 'dense' runs only where the whole mask is local"):
        backends.resolve("dense", cpu, chunked=True)
    q, k, v = qkv(1, 2, 1, 32, 8, torch.float64, seed=1)
    m, rows = masks.document([12, 20]), torch.arange(32)
    impl = backends.resolve("auto", cpu, chunked=True)
    got = backends.get(impl).forward(q, k, v, m, rows, 0.3)
    want = backends.get("torch").forward(q, k, v, m, rows, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_context_parallel_refuses_an_unknown_kernel_name_when_built():
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel

    with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'cute', 'triton', 'torch', 'dense'\), got 'fa3'"):
        ContextParallel("ring", shard(8, 2, "contiguous"), impl="fa3")
    assert ContextParallel("ring", shard(8, 2, "contiguous"), impl="auto").impl == "auto"
