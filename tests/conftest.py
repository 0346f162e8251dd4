"""Test configuration shared by the whole suite.

The Triton interpreter must be switched on before any kernel is defined, and only when no GPU is
present, so the same suite runs compiled kernels on a GPU machine.

Every test gets back the environment it started with: the trainer run in this process (``loop.main``)
writes the one-process launcher variables ``RANK`` / ``LOCAL_RANK`` (``parallel.init_distributed``)
and then destroys its process group, and a later Hugging Face Trainer in the same pytest process
(accelerate) read them as a torchrun launch and waited for a ``MASTER_ADDR`` rendezvous
(``tests/integrations/test_collator.py`` after ``tests/trainer``, in one run).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
