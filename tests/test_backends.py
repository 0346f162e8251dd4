"""The backend registry's public surface: names, get, and the deprecated launcher view kept for code
written against it (it delegates, it does not resolve on its own)."""

import pytest
import torch

from fm_parallel import backends, launchers, masks
from tests.helpers import qkv


def test_names_and_get():
    assert backends.names() == ("auto", "cute", "triton", "torch", "dense")
    assert backends.get("torch").deterministic and not backends.get("cute").deterministic
    assert not backends.get("dense").chunked
    with pytest.raises(ValueError, match=r"impl: expected one of \('auto'"):
        backends.get("auto")  # a resolved name is expected


def test_the_deprecated_launchers_delegate_to_the_registry():
    cpu = torch.device("cpu")
    assert launchers.LOCAL_IMPLS == ("cute", "triton", "torch")
    assert launchers.resolve(None, cpu) == launchers.default_impl(cpu) == backends.resolve("auto", cpu, chunked=True)
    with pytest.raises(ValueError, match="impl: 'dense' runs only where the whole mask is local"):
        launchers.resolve("dense", cpu)
    q, k, v = qkv(1, 2, 1, 32, 8, torch.float64, seed=1)
    m, rows = masks.document([12, 20]), torch.arange(32)
    got = launchers.forward(q, k, v, m, rows, 0.3, "torch")
    want = backends.get("torch").forward(q, k, v, m, rows, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        launchers.forward(q, k, v, m, rows, 0.3, "auto")


def test_context_parallel_refuses_an_unknown_kernel_name_when_built():
    from fm_parallel.distributed import shard
    from fm_parallel.distributed.context import ContextParallel

    with pytest.raises(ValueError, match=r"impl: expected one of \('auto', 'cute', 'triton', 'torch', 'dense'\), got 'fa3'"):
        ContextParallel("ring", shard(8, 2, "contiguous"), impl="fa3")
    assert ContextParallel("ring", shard(8, 2, "contiguous"), impl="auto").impl == "auto"
