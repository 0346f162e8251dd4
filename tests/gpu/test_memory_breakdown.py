"""GPU check of the allocator-history breakdown (fm_parallel/longcontext/memory_breakdown.py) and of
``max_context.py --memory-breakdown``: on a known pattern of allocations the replay finds the peak to
the byte and names the line that allocated each term; through the script, the peak it reports agrees
with ``torch.cuda.max_memory_allocated``.

    FM_FA4_SITE=/tmp/site python -m pytest -q -rs tests/gpu/test_memory_breakdown.py     # on the H200
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import needs_cuda

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


@needs_cuda
def test_a_known_pattern_peaks_where_it_should():
    from fm_parallel.longcontext.memory_breakdown import peak_breakdown, record

    device = torch.device("cuda")
    keep = torch.empty(8 * MIB, dtype=torch.uint8, device=device)  # before the recording: in start_gib only
    with record(device) as rec:
        a = torch.empty(256 * MIB, dtype=torch.uint8, device=device)
        b = torch.empty(128 * MIB, dtype=torch.uint8, device=device)
        del a  # the peak was a + b = 384 MiB
        c = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
        del keep  # memory from before the recording: ignored by the replay
    out = peak_breakdown(rec.snapshot, rec.start_bytes, rec.device_index, max_entries=rec.max_entries)
    del b, c
    assert out["step_peak_gib"] * 2**30 == 384 * MIB
    assert out["start_gib"] * 2**30 >= 8 * MIB and not out["trace_truncated"]
    sizes = sorted(round(t["gib"] * 2**30 / MIB) for t in out["terms"])
    assert sizes == [384], out["terms"]  # both live blocks were made on lines of this test (one term: torch's frame)


@needs_cuda
def test_max_context_memory_breakdown_agrees_with_the_allocator(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench.max_context", "--models", "tiny", "--impls", "flashmask",
         "--device", "cuda", "--calibrate", "2048", "4096", "--lengths", "8192", "--memory-breakdown", "8192",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "max_context_memory.json").read_text())
    assert out["fits"] and out["n"] == 8192 and not out["trace_truncated"]
    assert out["terms"] and out["static"]["frozen_params_gib"] > 0
    # The replay's peak (requested bytes) against the allocator's (rounded up to 512 bytes per block).
    assert out["peak_gib"] == pytest.approx(out["max_memory_allocated_gib"], rel=0.02, abs=8 / 1024)
    assert any(t["where"].startswith(("fm_parallel/", "launch/bench/")) for t in out["terms"]), out["terms"]


@needs_cuda
@pytest.mark.parametrize("compile_", ["off", "on"])
def test_a_checkpoint_every_2_layers_is_recorded(tmp_path, compile_):
    """torch's allocator history loses the exception with which a checkpoint stops its recompute
    early inside our tiled layer's autograd.Function (pytorch/pytorch#179536: met on the GPU at 64k and
    1M, every 2 or 3 layers, compiled and eager alike). The recorded step turns the early stop off
    (memory_breakdown.recordable_checkpoints) and records."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench.max_context", "--models", "tiny", "--impls", "flashmask",
         "--device", "cuda", "--checkpoint-every", "2", "--offload", "0", "--compile", compile_,
         "--memory-breakdown", "8192", "--time-limit", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "max_context_memory.json").read_text())
    assert out["checkpoint_every"] == 2 and out["checkpoint_early_stop"] is False
    assert out["fits"] is True and out["terms"] and "error" not in out, out
