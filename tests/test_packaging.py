"""The top-level kernels/ folder is fm_parallel.kernels, never a top-level ``kernels`` (issue 31.1).

PyPI's popular ``kernels`` package (which transformers imports) must win wherever a user starts
Python: pytest and ``python -c`` from the project root put the root on ``sys.path`` first. Each check
runs a fresh interpreter from the root, as the README's commands do.
"""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path = ROOT, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _pypi_kernels_installed() -> bool:
    out = _python("import importlib.util, sys; sys.path.pop(0); print(importlib.util.find_spec('kernels') is not None)",
                  cwd=Path("/"))
    return out.stdout.strip() == "True"


def test_import_kernels_from_the_project_root_is_never_ours():
    out = _python("import kernels, os; print(os.path.realpath(kernels.__file__))")
    if _pypi_kernels_installed():
        assert out.returncode == 0, out.stderr
        assert not out.stdout.strip().startswith(str(ROOT / "kernels")), out.stdout
    else:
        assert out.returncode != 0 and "ModuleNotFoundError: No module named 'kernels'" in out.stderr, out.stderr


# As if PyPI's kernels were not installed (older transformers, the H200 image): neither its files nor
# its metadata are found.
_HIDE_PYPI_KERNELS = """
import importlib.machinery as _m, importlib.metadata as _md, sys
_find = _m.PathFinder.find_spec.__func__
def _find_spec(cls, name, path=None, target=None):
    if name == "kernels":
        path = [p for p in (path if path is not None else sys.path) if "-packages" not in p]
    return _find(cls, name, path, target)
_m.PathFinder.find_spec = classmethod(_find_spec)
_version = _md.version
def _no_kernels(name):
    if name.lower() == "kernels":
        raise _md.PackageNotFoundError(name)
    return _version(name)
_md.version = _no_kernels
"""


def test_without_pypis_package_our_folder_is_still_not_importable_as_kernels():
    code = _HIDE_PYPI_KERNELS + """
import kernels
print("file", getattr(kernels, "__file__", None), hasattr(kernels, "__path__"), getattr(kernels, "__version__", None))
for name in ("kernels.plan", "kernels.triton_kernels"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        print("missing", name)
try:
    from kernels import get_kernel
except ModuleNotFoundError as e:
    print("missing", e.name)
"""
    out = _python(code)
    assert out.stdout.split("\n")[:4] == ["file None False None", "missing kernels.plan",
                                            "missing kernels.triton_kernels", "missing kernels"], (out.stdout, out.stderr)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the [test] extra's transformers")
def test_without_pypis_package_transformers_imports_from_the_project_root():
    # transformers probes `kernels` with find_spec (which finds our folder), then imports it when no
    # metadata names a version: the probe must read "not installed", not crash (seen on the H200 image).
    code = _HIDE_PYPI_KERNELS + """
from transformers.utils.import_utils import is_kernels_available
from transformers import AutoModelForCausalLM, LlamaConfig
import peft
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2)
print(is_kernels_available(), type(AutoModelForCausalLM.from_config(cfg)).__name__)
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "False LlamaForCausalLM", out.stdout


def test_fm_parallel_kernels_is_the_projects_folder():
    out = _python("import os, fm_parallel.kernels as k, fm_parallel.kernels.plan as p; "
                  "print(os.path.realpath(os.path.dirname(k.__file__))); print(k.__name__, p.__name__)")
    assert out.returncode == 0, out.stderr
    folder, names = out.stdout.strip().splitlines()
    assert names == "fm_parallel.kernels fm_parallel.kernels.plan"
    if Path(folder) != ROOT / "kernels":  # an installed (non-editable) copy: the same sources
        assert (Path(folder) / "plan.py").read_bytes() == (ROOT / "kernels" / "plan.py").read_bytes()


@pytest.mark.skipif(importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None,
                    reason="needs the [test] extra's transformers and peft")
def test_the_documented_adapter_recipe_runs_from_the_project_root(tmp_path):
    # docs/training.md: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter),
    # started where a user starts it (the project root). With the old layout `import peft` failed here.
    code = f"""
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(r"{tmp_path}/base")
lora = get_peft_model(AutoModelForCausalLM.from_pretrained(r"{tmp_path}/base"),
                      LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
lora.save_pretrained(r"{tmp_path}/adapter")
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(r"{tmp_path}/base"), r"{tmp_path}/adapter")
print(type(model).__name__, model(torch.arange(8)[None]).logits.shape[-1])
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1].split() == ["PeftModel", "64"], out.stdout


def test_a_built_wheel_has_no_top_level_kernels(tmp_path):
    flags = [] if importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel") else None
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)]
    if flags is not None:
        cmd.insert(5, "--no-build-isolation")  # offline-friendly when the build tools are here
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("fm_parallel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fm_parallel/kernels/__init__.py" in names and "fm_parallel/kernels/plan.py" in names
    assert not [n for n in names if n.split("/")[0] == "kernels"], "the wheel ships a top-level kernels package"
