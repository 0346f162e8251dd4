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


def test_without_pypis_package_import_kernels_is_a_missing_module():
    # The root alone on sys.path (no site-packages): our folder must not answer to "kernels".
    code = ("import sys; sys.path[:] = [''] + [p for p in sys.path if p.endswith('.zip') or 'site-packages' not in p and "
            "'dist-packages' not in p]\n"
            "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)\n"
            "else:\n    print('imported', kernels.__file__)")
    out = _python(code, ROOT, "-S")
    assert out.stdout.strip() == "missing kernels", (out.stdout, out.stderr)


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
