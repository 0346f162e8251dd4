"""The CuTe backend (impl="cute") where flash-attn-4 is installed: FA4's real SM90 kernels compiled with
our mask_mod and block sparsity, on the CPU (nothing launched). Numbers are checked on the H200 by
tests/gpu/test_kernels.py; without the [cute] extra (CPU CI) these tests are skipped, saying so."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flash_attn.cute", reason="flash-attn-4 not installed (the [cute] extra); GPU check: tests/gpu/test_kernels.py")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["d128 docs", "d128 4 intervals", "d256 docs"])
def test_fa4_kernels_compile_with_our_mask_mod_and_reuse_them_for_a_new_mask(case):
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cute_compile_check.py")), "--only", case],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "1/1 PASS" in proc.stdout


def _traced_paths(case: str) -> dict:
    """The compile check's record of which masking / forward schedule the FA4 changes gave the kernels."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cute_compile_check.py")), "--only", case,
                               "--json", str(out)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    return rows[0]["traced"]


@pytest.mark.parametrize("case", ["d128 docs", "d128 zigzag shard (explicit rows)", "d256 docs", "d128 mask per Q head"])
def test_our_kernels_mask_column_first_and_run_both_passes_heaviest_first(case):
    """Both passes take the cost-ordered scheduler: PackGQA's forward (docs: one mask head, 4 query
    heads on 2 KV heads), explicit rows, D = 256's smaller tiles, a mask per query head (no PackGQA)."""
    traced = _traced_paths(case)
    assert traced.get("cost_order") == 1 and traced.get("cost_order_bwd") == 1, traced
    assert not any(k.startswith(("grid_order", "reversed_order", "cost_order_unavailable")) for k in traced), traced
    assert "per_score" not in traced and "per_score_transposed" not in traced, traced
    # the forward masks column-first (not transposed); the D <= 128 backward works on S^T
    assert traced.get("column_first", 0) >= 1, traced
    if case.startswith("d128"):
        assert traced.get("column_first_transposed", 0) >= 1, traced


def test_fa4_changes_leave_other_mask_mods_and_switched_off_options_alone(tmp_path):
    """A mask_mod that is not ours (Flex's, a user's) and ours with the changes off trace FA4's own code."""
    script = r'''
import os
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a"); os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
import sys; sys.path.insert(0, sys.argv[1])
import cutlass, cutlass.cute as cute, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute import utils as fa4_utils
from flash_attn.cute.interface import _flash_attn_fwd
from tests.kernels import cute_compile_check as check
from fm_parallel.kernels.fa4 import patches as fa4_patches
from fm_parallel.kernels.fa4 import backend as fa4_backend

@cute.jit
def foreign(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
    return fa4_utils.scalar_to_ssa(aux_tensors[0][kv_idx[0]] <= q_idx[0], cutlass.Boolean)

case = [c for c in check.CASES if c[0] == "d128 docs"][0]
with FakeTensorMode(allow_non_fake_inputs=True):
    fa4_backend.OPTIONS = fa4_patches.Options(False, "grid")
    check.run_case(case, False)
    ours_off = dict(fa4_patches.traced)
    fa4_patches.traced.clear()
    q, k, v = (torch.empty(1, 300, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    _flash_attn_fwd(q, k, v, mask_mod=foreign, aux_tensors=[torch.empty(300, dtype=torch.int32, device="cuda")])
    print("OFF", sorted(ours_off.items()), "FOREIGN", sorted(fa4_patches.traced.items()))
'''
    (tmp_path / "foreign.py").write_text(script)  # CuTe DSL reads a jit function's source from its file
    proc = subprocess.run([sys.executable, str(tmp_path / "foreign.py"), str(ROOT)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("OFF")][-1]
    off, foreign = line[4:].split(" FOREIGN ")
    assert "per_score" in off and "grid_order" in off and "grid_order_bwd" in off, line
    assert "column_first" not in off and "cost_order" not in off and "reversed" not in off, line
    assert foreign == "[('grid_order', 1)]", line  # FA4's own masking (not ours, not counted), grid order


def test_masks_that_know_they_are_causal_documents_compile_fa4s_causal_and_varlen_kernels(tmp_path):
    """Plain causal (any batch) takes FA4's causal kernel, packed causal documents (one batch row) its
    varlen kernel, both directions, on views of our layout; anything else the block-sparse path."""
    script = r'''
import os, sys
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a"); os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
sys.path.insert(0, sys.argv[1])
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tests.kernels import cute_compile_check as check
from fm_parallel.kernels.fa4 import backend as fa4_backend
from fm_parallel.derived import derived_for_mask
from fm_parallel.masks.flashmask import FlashMask

check._allow_fake_semaphores()
fa4_backend._sparsity = check._sparsity_on_cpu
for lengths, b in (((300,), 2), ((100, 150, 50), 1), ((100, 200), 2), (None, 1)):
    with FakeTensorMode(allow_non_fake_inputs=True):
        n = 300
        q = torch.empty(b, 4, n, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(b, 2, n, 128, dtype=torch.bfloat16, device="cuda")
        bounds = [torch.empty(1, 1, n, 1, dtype=torch.int32, device="cuda") for _ in range(2)]
        mask = FlashMask(*bounds, n, validate=False)
        mask.set_causal_documents(lengths)
        if lengths and len(lengths) > 1:  # the pinned upload is real work: hand over its fake result
            derived_for_mask("fa4").get((mask,), ("cu_seqlens", lengths), lambda: torch.empty(len(lengths) + 1, dtype=torch.int32, device="cuda"))
        pos = torch.arange(n, device="cuda")
        before = dict(fa4_backend.paths)
        out, lse = fa4_backend.cute_fwd(q, k, k, mask, pos, 0.1, 0)
        fa4_backend.cute_bwd(q, k, k, out, lse, torch.empty_like(out), mask, pos, 0.1, torch.empty_like(lse), 0)
        took = [p for p, c in fa4_backend.paths.items() if c != before.get(p, 0)]
        print("PATH", lengths, b, took)
'''
    (tmp_path / "dense_paths.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "dense_paths.py"), str(ROOT)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    took = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("PATH")]
    assert took == ["(300,) 2 ['fa4_causal']", "(100, 150, 50) 1 ['fa4_varlen']", "(100, 200) 2 ['block_sparse']",
                    "None 1 ['block_sparse']"], took


def test_another_fa4_version_is_left_unchanged_with_a_warning(tmp_path):
    script = r'''
import importlib.metadata, logging, sys
sys.path.insert(0, sys.argv[1])
real = importlib.metadata.version
importlib.metadata.version = lambda name: "4.0.0b99" if name == "flash-attn-4" else real(name)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from fm_parallel.kernels.fa4 import patches as fa4_patches
from flash_attn.cute import flash_fwd_sm90, mask, tile_scheduler
print("INSTALLED", fa4_patches.install(), hasattr(mask.AttentionMask.apply_mask, "fm_parallel_original"),
      flash_fwd_sm90.SingleTileScheduler is tile_scheduler.SingleTileScheduler)
'''
    (tmp_path / "other_version.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "other_version.py"), str(ROOT)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "INSTALLED False False True" in proc.stdout, proc.stdout
    from fm_parallel.kernels.fa4.pin import pinned_fa4

    assert f"4.0.0b99 is not the pinned {pinned_fa4()}" in proc.stdout, proc.stdout
