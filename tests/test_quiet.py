"""Clean output (issue 56.5): the known-harmless warnings are silenced by message in one place
(``fm_parallel/quiet.py``), nothing else is, and a tiny GPU-less run of the trainer prints no warning
of ours or of the libraries it drives."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_exactly_the_known_harmless_warnings_are_silenced():
    from fm_parallel.quiet import KNOWN_HARMLESS, silence_known_harmless

    samples = ["`is_gradient_checkpointing` is deprecated and will be removed",
               "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single process.",
               "Argument aux_data with value AuxData(tensors=...) cannot be converted to a JitArgument"]
    assert len(samples) == len(KNOWN_HARMLESS) and all(reason for _, reason in KNOWN_HARMLESS)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_known_harmless()
        for text in samples:
            warnings.warn(text, UserWarning)
        warnings.warn("something else", UserWarning)  # not on the list: still shown
    assert [str(w.message) for w in seen] == ["something else"]


def test_a_tiny_cpu_run_prints_no_warning(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FM_", "OMP_")) and k not in ("RANK", "LOCAL_RANK")}
    env.pop("TRITON_INTERPRET", None)  # a user's shell does not set it
    proc = subprocess.run([sys.executable, "launch/train.py", "--nproc_per_node", "2", "--model.hidden_size", "32",
                           "--model.layers", "1", "--model.heads", "2", "--model.kv_heads", "1", "--model.intermediate_size", "64",
                           "--model.lora_rank", "2", "--data.seq_len", "64", "--training.steps", "2", "--training.warmup", "0",
                           "--training.loss_chunk", "64", "--output.checkpoint_every", "0", "--eval.rows", "1",
                           "--output.dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed, when installed (the test extra), announces its CPU accelerator as accelerate imports it:
    # not a warning about this run, and not printed in a user's `[train]` install.
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "real_accelerator.py" not in line]
    noisy = [line for line in lines if re.search(r"warn|deprecat|destroy_process_group|Guessing device", line, re.I)]
    assert not noisy, noisy
