"""docs/parallelism.md's torchrun line for context parallelism with one's own model runs as written
(2 gloo ranks) and prints the losses of one process (issue 31.7)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = "torchrun --standalone --nproc_per_node 2 launch/examples/cp_own_model.py --cp ring"
ONE_PROCESS = "python launch/examples/cp_own_model.py"


def _losses(command: str) -> list[float]:
    argv = command.split()
    # The venv's own torchrun / python, as the user's shell would find them once it is activated.
    argv[0] = str(Path(sys.executable).with_name(argv[0])) if argv[0] == "torchrun" else sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # a user's shell does not set it (the CPU path is the PyTorch one anyway)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", done.stdout, flags=re.M)]


def test_the_documented_torchrun_line_prints_one_process_losses(monkeypatch):
    docs = (ROOT / "docs/parallelism.md").read_text()
    assert TORCHRUN in docs and ONE_PROCESS in docs  # the test runs what the docs say
    cp = _losses(TORCHRUN)
    # The one-process line is the same script without torchrun: run in this process (a second
    # interpreter's start costs more than the run), its printed losses returned by main().
    spec = importlib.util.spec_from_file_location("cp_own_model", ROOT / ONE_PROCESS.split()[1])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # (accelerate leaves one in os.environ)
    one = example.main([])
    assert len(cp) == len(one) == 3, (cp, one)
    assert all(abs(a - b) < 1e-5 for a, b in zip(cp, one)), (cp, one)
    assert one[-1] < one[0]  # it trains


def test_the_docs_snippet_is_the_examples_code():
    docs = (ROOT / "docs/parallelism.md").read_text()
    section = docs[docs.index("## Your own model under torchrun"):]
    snippet = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    example = {line.strip() for line in (ROOT / "launch/examples/cp_own_model.py").read_text().splitlines()}
    missing = [line for line in snippet.splitlines() if line.strip() not in example and line.strip() != "..."]
    assert not missing, missing
