"""The top-level kernels/ folder holds fm_parallel.kernels.<language>, never a top-level ``kernels``
(issues 31.1, 54.1).

PyPI's popular ``kernels`` package (which transformers imports) must win wherever a user starts
Python: pytest and ``python -c`` from the project root put the root on ``sys.path`` first. Each check
runs a fresh interpreter from the root, as the README's commands do.
"""

import importlib.util
import os
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
    # kernels/ has no __init__.py: PyPI's regular package outranks a namespace folder wherever it sits
    # on sys.path; without PyPI's, the folder is an empty namespace (no __file__), not a package of ours.
    out = _python("import kernels; print(getattr(kernels, '__file__', None))")
    if _pypi_kernels_installed():
        assert out.returncode == 0 and "-packages" in out.stdout, (out.stdout, out.stderr)
    else:
        assert out.returncode == 0 and out.stdout.strip() == "None", (out.stdout, out.stderr)


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


def test_fm_parallel_kernels_holds_the_projects_kernel_folders():
    out = _python("import os, fm_parallel.kernels.triton.backend as t, fm_parallel.kernels.fa4.sparsity as f; "
                  "print(os.path.realpath(t.__file__)); print(os.path.realpath(f.__file__))")
    assert out.returncode == 0, out.stderr
    for found, source in zip(out.stdout.split(), (ROOT / "kernels/triton/backend.py", ROOT / "kernels/fa4/sparsity.py")):
        assert Path(found).read_bytes() == source.read_bytes()  # the sources, or an installed copy of them


def test_a_source_checkout_on_pythonpath_finds_the_kernel_folders(tmp_path):
    # The GPU machine runs the working tree with PYTHONPATH=$PWD, nothing installed (no symlink needed):
    # the editable install's finder is taken out first, so only the path can find our modules.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            "import fm_parallel.kernels.triton.plan as p; print(p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(ROOT / "kernels" / "triton" / "plan.py")


def test_the_fa4_pin_is_pyprojects_cute_extra():
    from fm_parallel.kernels.fa4.pin import pinned_fa4

    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    cute = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cute"]
    assert f"flash-attn-4=={pinned_fa4()}" in cute, cute


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
    for name in ("fm_parallel/kernels/__init__.py", "fm_parallel/kernels/plan.py", "fm_parallel/kernels/triton/backend.py",
                 "fm_parallel/kernels/fa4/patches.py", "fm_parallel/kernels/fa4/pin.py"):
        assert name in names, name
    assert not [n for n in names if n.split("/")[0] == "kernels"], "the wheel ships a top-level kernels package"
