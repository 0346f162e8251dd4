"""GPU verification: the CUDA kernels, the Hugging Face edges and context parallelism checked on a GPU.

Run on the H200 (``python -m pytest -q -rs tests/gpu``); without CUDA every GPU test is skipped with
the reason. A few tests here run the same cases on the CPU through the PyTorch path, so that the
cases themselves never reach a GPU session broken.
"""

import gc
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
NO_GPU = "needs a CUDA GPU (run on the H200: python -m pytest -q -rs tests/gpu)"

needs_cuda = pytest.mark.skipif(not CUDA, reason=NO_GPU)


def needs_gpus(n: int):
    """Skip unless ``n`` CUDA devices are visible (NCCL ranks need one GPU each)."""
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA GPUs (NCCL ranks, one GPU each), found {GPUS}")


def release_gpu_memory() -> None:
    """Give the GPU memory this pytest process no longer uses back to the device.

    Run before every GPU test (``conftest.py``), because several tests start other processes on the
    same GPU (the trainer, ``max_context.py``, torchrun ranks) and they can use only what this process
    does not hold. Two things hold memory after a test ends: the caching allocator keeps what the test
    freed (about 68 GiB after ``test_wide.py``), and a test that failed keeps its tensors alive through
    ``sys.last_traceback`` (pytest's post-mortem hook) until the next test's body starts. On an H100
    (80 GB), with ``test_wide.py``'s 68 GiB still held, the 4 shared-GPU ranks of ``test_multi_gpu.py``
    stopped at their first 131k case (most likely for want of memory; the traceback was cut), which no
    test run alone shows.
    """
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
