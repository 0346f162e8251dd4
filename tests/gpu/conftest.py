"""The FA4 path for the GPU tests.

``FM_FA4_SITE``: a folder holding the unpacked flash-attn-4 and NVIDIA CUTLASS DSL wheels (what the
git-ignored FA4 pack recipe builds, e.g. ``/tmp/site``), for a machine where they are not installed.
It goes on ``sys.path`` (and on ``PYTHONPATH``, for the torchrun ranks these tests start) before any
test imports the CuTe backend. Without it the installed ``[cute]`` extra is used, or the CuTe cases
are skipped, saying so.

Every test starts with the GPU memory earlier tests left behind given back (``release_gpu_memory``).
"""

import os
import sys
from pathlib import Path

import pytest

from tests.gpu import release_gpu_memory

site = os.environ.get("FM_FA4_SITE")
if site:
    folders = [Path(site), Path(site) / "nvidia_cutlass_dsl" / "dsl_packages"]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        raise RuntimeError(f"FM_FA4_SITE: expected unpacked FA4 / CUTLASS DSL wheels, missing {missing}")
    for folder in reversed(folders):
        sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


@pytest.fixture(autouse=True)
def _gpu_memory_of_earlier_tests_released():
    release_gpu_memory()
