"""docs/huggingface.md's context-parallelism commands run as written: the torchrun lines of
launch/examples/hf_trainer_cp.py and launch/examples/trl_sft_cp.py (2 gloo ranks, ring and Ulysses,
DPO shared prompts, and DeepSpeed ZeRO-3 under cp=) print the ``step N loss X`` lines of the
one-process line (issue 34; ZeRO-3: issue 52 item 4)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
HF_ONE = "python launch/examples/hf_trainer_cp.py --cp-degree 1 --steps 3"
TRL_ONE = "python launch/examples/trl_sft_cp.py --cp-degree 1 --steps 3"
TORCHRUN = "torchrun --standalone --nproc_per_node 2 launch/examples/{} --cp-degree 2 --steps 3"
CASES = [("hf_trainer_cp.py", ""), ("hf_trainer_cp.py", " --cp-mode ulysses"), ("hf_trainer_cp.py", " --dpo"),
         ("trl_sft_cp.py", ""), ("trl_sft_cp.py", " --cp-mode ulysses"), ("hf_trainer_cp.py", " --zero 3")]


def _printed(command: str) -> list[float]:
    argv = command.split()
    # The venv's own torchrun / python, as the user's shell would find them once it is activated.
    argv[0] = str(Path(sys.executable).with_name(argv[0])) if argv[0] == "torchrun" else sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # a user's shell does not set it
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", done.stdout, flags=re.M)]


def _one_process(script: str, extra: list[str], monkeypatch) -> list[float]:
    """The one-process line, run in this process (a second interpreter's start costs more than the
    run): the losses its ``main()`` logged, which it prints with 6 decimals."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # (accelerate leaves one in os.environ)
    monkeypatch.syspath_prepend(str(ROOT / "launch/examples"))  # as running the script puts its folder there
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "launch/examples" / script)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(["--cp-degree", "1", "--steps", "3"] + extra)


@pytest.mark.parametrize("script, extra", CASES, ids=[s[:-3] + (e.replace(" --", "-") or "-ring") for s, e in CASES])
def test_the_torchrun_line_prints_the_one_process_losses(script, extra, monkeypatch):
    if script.startswith("trl"):
        pytest.importorskip("trl")
    if "--zero" in extra:
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    command = TORCHRUN.format(script) + extra
    docs = (ROOT / "docs/huggingface.md").read_text()
    assert command in docs and (HF_ONE if script.startswith("hf") else TRL_ONE) in docs  # the test runs what the docs say
    cp = _printed(command)
    # ZeRO partitions the weights and optimizer state, not the arithmetic: one plain process's losses.
    one = _one_process(script, extra.split() if "--zero" not in extra else [], monkeypatch)
    assert len(cp) == len(one) == 3, (cp, one)
    assert all(abs(a - b) < 1e-5 for a, b in zip(cp, one)), (cp, one)  # printed with 6 decimals
