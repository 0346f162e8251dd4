"""GPU check of the memory plan made phase by phase (fm_parallel/trainer/capacity.py, ``StepBudget`` in
fm_parallel/longcontext/memory.py): the phases' peaks add up to the step's own peak (the resets between
them lose nothing), and the trainer's own plan, asked for a length directly, holds its steps.

    FM_FA4_SITE=/tmp/site python -m pytest -q -rs tests/gpu/test_memory_plan.py     # on the H200
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.gpu import needs_cuda

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model.hidden_size", "1024", "--model.layers", "4", "--model.heads", "8", "--model.kv_heads", "2",
         "--model.intermediate_size", "2048", "--model.lora_rank", "8", "--model.tile_chunk", "4096",
         "--model.attention_chunk", "8192", "--training.loss_chunk", "4096", "--parallel.cp", "none"]


@needs_cuda
def test_the_phases_peaks_are_the_steps_peak():
    """The same step twice: once under torch's plain peak, once phase by phase (the peak reset at
    each phase's end). The largest phase is the plain peak, to the allocator's rounding."""
    from fm_parallel import masks
    from fm_parallel.trainer.capacity import PhasePeaks, measured_loss
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.model import build_model

    device = torch.device("cuda")
    cfg = load_config([*SMALL, "--data.seq_len", "32768"], environ={})
    model = build_model(cfg, 258, device)
    n = 32768
    mask = masks.document(masks.sample_lengths(n)).to(device)
    ids = torch.randint(0, 258, (1, n), device=device)

    def step(peaks=None):
        loss = measured_loss(model, ids, ids, mask, 4096, "auto", peaks)
        if peaks is not None:
            peaks.end("forward")
        loss.backward()
        if peaks is not None:
            peaks.end("layers_backward")
        model.zero_grad(set_to_none=True)

    step()  # warm: compiles the tiled parts outside both measurements
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    static = torch.cuda.memory_allocated(device)
    step()
    plain = torch.cuda.max_memory_allocated(device) - static
    peaks = PhasePeaks(device)
    step(peaks)
    assert list(peaks.peaks) == ["forward", "loss_backward", "layers_backward"]
    assert abs(max(peaks.peaks.values()) - plain) <= 2**20, (peaks.peaks, plain)


@needs_cuda
def test_the_trainers_plan_holds_its_steps(tmp_path):
    """Through the trainer's command, a length asked directly with ``memory_plan = "auto"``: every
    step's peak is at or under the plan it printed (no ``memory plan missed`` warning)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FM_") or k == "FM_FA4_SITE"}
    proc = subprocess.run(
        [sys.executable, "-m", "fm_parallel.launch", *SMALL, "--data.seq_len", "65536", "--model.memory_plan", "auto",
         "--training.steps", "2", "--training.warmup", "1", "--output.dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "memory plan: 65536 tokens:" in out and "peaks at this length" in out, out[-4000:]
    assert "memory plan missed" not in out, out[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "memory_gib" in r]
    assert len(steps) == 2 and all(r["memory_gib"] <= r["planned_gib"] for r in steps), steps


@needs_cuda
def test_the_scripts_default_plan_measures_one_layer_and_holds(tmp_path):
    """``max_context.py`` without ``--calibrate``: its plan measures one layer as the trainer's does
    (``capacity.measure_layer_budget``), and the length asked peaks at or under the plan (no ``plan
    missed`` warning)."""
    proc = subprocess.run(
        [sys.executable, "-m", "launch.bench.max_context", "--models", "tiny", "--impls", "flashmask",
         "--device", "cuda", "--tile-chunk", "4096", "--attention-chunk", "8192", "--loss-chunk", "4096",
         "--lengths", "65536", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert '"calibration": "measured on one layer at 16384 and 32768 tokens"' in out, out[-4000:]
    assert "plan missed" not in out, out[-4000:]
    row = json.loads((tmp_path / "max_context.jsonl").read_text().splitlines()[0])
    assert row["fits"] and row["peak_gib"] <= row["planned_device_gib"], row


# Holds ``sys.argv[1]`` bytes of the GPU and says so; stays until killed: another job on the same GPU.
_HOLDER = ("import sys, time, torch; x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda'); "
           "torch.cuda.synchronize(); print('held', flush=True); time.sleep(3600)")


@needs_cuda
def test_the_trainers_plan_keeps_within_what_another_process_leaves(tmp_path):
    """Another process holds all but 20 GiB of the GPU while the trainer plans with ``memory_plan =
    "auto"``: the plan says how much is held elsewhere (what the other process took, to this machine's
    CUDA contexts), keeps within 94% of the GPU less that, and every step peaks under its plan. Before
    the plan counted it (``memory.gpu_memory_budget``), it planned against the whole GPU, and a length
    planned near the GPU's size would have run out of memory mid-step; without it this test fails on
    the missing line."""
    import re

    from fm_parallel.longcontext.memory import GIB

    total = torch.cuda.get_device_properties(0).total_memory
    free_before, _ = torch.cuda.mem_get_info()
    hold = free_before - 20 * GIB
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(hold)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        held = free_before - torch.cuda.mem_get_info()[0]  # the tensor and the holder's own context
        env = {k: v for k, v in os.environ.items() if not k.startswith("FM_") or k == "FM_FA4_SITE"}
        proc = subprocess.run(
            [sys.executable, "-m", "fm_parallel.launch", *SMALL, "--data.seq_len", "65536", "--model.memory_plan",
             "auto", "--training.steps", "2", "--training.warmup", "1", "--output.dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
        )
    finally:
        holder.kill()
        holder.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    said = re.search(r"memory plan: ([\d.]+) GiB of this GPU is held outside this process's tensors .*? the plan keeps "
                     r"within the ([\d.]+) GiB left", out)
    assert said, out[-4000:]
    elsewhere, left = float(said[1]), float(said[2])
    # this pytest process's context and the trainer's own, against the 1 GiB the budget allows for one
    assert abs(elsewhere - held / GIB) < 1.0, (elsewhere, held / GIB)
    assert abs(left - (0.94 * total / GIB - elsewhere)) < 0.11, (left, total / GIB, elsewhere)
    assert "memory plan missed" not in out, out[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "memory_gib" in r]
    assert len(steps) == 2 and all(r["memory_gib"] <= r["planned_gib"] <= left for r in steps), (steps, left)
