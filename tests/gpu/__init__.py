"""GPU verification: the CUDA kernels, the Hugging Face edges and context parallelism checked on a GPU.

Run on the H200 (``python -m pytest -q -rs tests/gpu``); without CUDA every GPU test is skipped with
the reason. A few tests here run the same cases on the CPU through the PyTorch path, so that the
cases themselves never reach a GPU session broken.
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
NO_GPU = "needs a CUDA GPU (run on the H200: python -m pytest -q -rs tests/gpu)"

needs_cuda = pytest.mark.skipif(not CUDA, reason=NO_GPU)


def needs_gpus(n: int):
    """Skip unless ``n`` CUDA devices are visible (NCCL ranks need one GPU each)."""
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA GPUs (NCCL ranks, one GPU each), found {GPUS}")
