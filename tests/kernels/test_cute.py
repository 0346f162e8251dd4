"""The CuTe backend (impl="cute") where flash-attn-4 is installed: FA4's real SM90 kernels compiled with
our mask_mod and block sparsity, on the CPU (nothing launched). Numbers are checked on the H200 by
launch/bench/verify_gpu.py; without the [cute] extra (CPU CI) these tests are skipped, saying so."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flash_attn.cute", reason="flash-attn-4 not installed (the [cute] extra); GPU check: launch/bench/verify_gpu.py")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["d128 docs", "d128 4 intervals", "d256 docs"])
def test_fa4_kernels_compile_with_our_mask_mod_and_reuse_them_for_a_new_mask(case):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "cute_compile_check.py"), "--only", case],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "1/1 PASS" in proc.stdout
