"""Test configuration shared by the whole suite.

The Triton interpreter must be switched on before any kernel is defined, and only when no GPU is
present, so the same suite runs compiled kernels on a GPU machine.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
