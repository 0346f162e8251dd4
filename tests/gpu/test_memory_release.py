"""Each GPU test starts with the GPU memory of the tests before it given back (``release_gpu_memory``).

Runs on the CPU too: there it checks that a failed test's tensors are no longer held by pytest's
post-mortem hook; on a GPU also that the caching allocator returned what they used.
"""

import sys
import weakref

import torch

from tests.gpu import CUDA, needs_cuda, release_gpu_memory


def _fail_holding(tensor: torch.Tensor) -> None:
    held = tensor  # noqa: F841 - kept alive by the frame, as a failed test's locals are
    raise AssertionError("a test that failed")


def test_a_failed_tests_tensors_and_the_allocators_cache_are_given_back():
    device = "cuda" if CUDA else "cpu"
    tensor = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    alive = weakref.ref(tensor)
    try:
        _fail_holding(tensor)
    except AssertionError as e:  # what pytest_runtest_call stores after a failed test
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
    del tensor
    assert alive() is not None  # held through sys.last_traceback, as pytest holds it until the next test
    release_gpu_memory()
    assert alive() is None and not hasattr(sys, "last_traceback")
    if CUDA:
        assert torch.cuda.memory_reserved() == 0, torch.cuda.memory_summary()


@needs_cuda
def test_leaves_memory_in_the_allocators_cache():
    """Sets up the next test: 1 GiB freed but still reserved by this process when the test ends."""
    torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() >= 1 << 30


@needs_cuda
def test_the_next_gpu_test_starts_with_none_held():
    """The conftest fixture ran between the two tests: the GPU has back what the test above left."""
    assert torch.cuda.memory_reserved() == 0, torch.cuda.memory_summary()
