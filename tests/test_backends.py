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


def test_resolve_is_marked_a_constant_result_as_torch_marks_one_and_import_loads_no_dynamo():
    """``resolve`` is baked into compiled graphs (torch.compile runs it once while tracing): its mark is
    the one ``torch.compiler.assume_constant_result`` sets (the fullgraph compile in
    tests/kernels/test_triton.py relies on it), set without importing ``torch._dynamo``, which cost
    every interpreter importing fm_parallel 1.1 s (every spawned rank of the suite included)."""
    import subprocess
    import sys

    def plain():
        return 0

    marked = torch.compiler.assume_constant_result(plain)
    assert marked is plain and vars(plain) and set(vars(plain)) <= set(vars(backends.resolve))
    assert all(getattr(backends.resolve, k) == v for k, v in vars(plain).items())
    code = "import sys, fm_parallel, fm_parallel.distributed, fm_parallel.trainer.loop; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
