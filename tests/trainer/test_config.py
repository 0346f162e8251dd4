"""Every config key is type-, range- and choice-checked when loaded, with the key named; --help lists
every key once with its default."""

import subprocess
import sys
from pathlib import Path

import pytest

from fm_parallel.trainer.config import Config, ConfigError, describe, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, message", [
    (["--training.steps", "-3"], r"training.steps: expected a value >= 1, got -3"),
    (["--training.steps", "0"], r"training.steps: expected a value >= 1, got 0"),
    (["--training.steps", "2.7"], r"training.steps: expected int, got '2.7'"),
    (["--data.seq_len", "0"], r"data.seq_len: expected a value >= 2"),
    (["--data.seq_len", "-64"], r"data.seq_len: expected a value >= 2"),
    (["--training.grad_accum", "0"], r"training.grad_accum: expected a value >= 1, got 0"),
    (["--model.dtype", "int8"], r"model.dtype: expected auto, float32, bfloat16 or float64, got 'int8'"),
    (["--parallel.balance", "spiral"], r"parallel.balance: expected contiguous, zigzag or mask, got 'spiral'"),
    (["--training.lr", "0"], r"training.lr: expected a value > 0.0, got 0.0"),
    (["--training.lr", "nan"], r"training.lr: expected a finite float"),
    (["--output.resume", "maybe"], r"output.resume: expected a boolean"),
    (["--parallel.cp_degree", "0"], r"parallel.cp_degree: expected a value >= 1 or -1, got 0"),
    (["--output.stop_after", "0"], r"output.stop_after: expected a value >= 1 or -1, got 0"),
    (["--model.kv_heads", "3"], r"model.kv_heads: expected a divisor of model.heads = 4, got 3"),
    (["--model.hidden_size", "250"], r"model.hidden_size: expected a multiple of model.heads = 4, got 250"),
    (["--parallel.ulysses_degree", "2"], r"parallel.ulysses_degree: expected 1 unless parallel.cp is hybrid"),
    (["--model.lora_targets", " , "], r"model.lora_targets: expected at least one module name"),
    (["--output.dir", ""], r"output.dir: expected a directory path"),
    (["--output.resume", "true", "--output.overwrite", "true"], r"output.overwrite: expected false when resuming"),
    (["--training.nope", "1"], r"unknown key training.nope"),
    (["--nope.steps", "1"], r"unknown section 'nope'"),
    (["--training.steps"], r"expected a value after --training.steps"),
    (["steps=3"], r"expected --section.key VALUE"),
])
def test_command_line_values_are_checked_with_the_key_named(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv, environ={})


@pytest.mark.parametrize("toml, message", [
    ("[training]\nsteps = 2.7\n", r"training.steps: expected int, got 2.7 \(float\)"),
    ("[training]\nsteps = true\n", r"training.steps: expected int, got True \(bool\)"),
    ("[training]\nsteps = \"5\"\n", r"training.steps: expected int, got '5' \(str\)"),
    ("[training]\nlr = \"fast\"\n", r"training.lr: expected a finite float"),
    ("[output]\nresume = 1\n", r"output.resume: expected a boolean"),
    ("[data]\npath = 5\n", r"data.path: expected a string, got 5"),
    ("[data]\nseq_len = -1\n", r"data.seq_len: expected a value >= 2"),
    ("steps = 3\n", r"expected \[section\] tables, got a top-level 'steps'"),
    ("[training\nsteps = 3\n", r"is not valid TOML"),
])
def test_toml_values_are_never_rounded_or_cast(tmp_path, toml, message):
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(["--config", str(f)], environ={})
    if "TOML" in message:
        assert str(f) in str(info.value)  # the file is named


def test_valid_values_of_every_kind_load(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nsteps = 3\nlr = 1\n[output]\nresume = false\n[parallel]\nimpl = \"\"\n")
    cfg = load_config(["--config", str(f), "--parallel.cp_degree", "-1", "--output.overwrite", "yes"],
                      environ={"FM_TRAINING__WARMUP": " 2 "})
    assert (cfg.training.steps, cfg.training.lr, cfg.training.warmup, cfg.output.overwrite) == (3, 1.0, 2, True)
    assert isinstance(cfg.training.lr, float)
    with pytest.raises(ConfigError, match="environment FM_TRAINING__NOPE: unknown key"):
        load_config([], environ={"FM_TRAINING__NOPE": "1"})
    with pytest.raises(ConfigError, match="--config: expected an existing TOML file"):
        load_config(["--config", str(tmp_path / "missing.toml")], environ={})


def test_help_lists_every_key_once_with_its_default():
    proc = subprocess.run([sys.executable, "launch/train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for section in ("model", "data", "training", "parallel", "output"):
        for key, value in getattr(Config(), section).__dict__.items():
            flag = f"--{section}.{key} "
            assert proc.stdout.count(flag) == 1, (flag, proc.stdout)
            assert f"default {value!r}" in proc.stdout
    assert describe().count("\n") >= 35
