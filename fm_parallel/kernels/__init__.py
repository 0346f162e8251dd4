"""The attention kernels: one subpackage per kernel language, and what they share.

    fm_parallel.kernels.plan        block-sparse launch plans from the shared tile rule (PyTorch)
    fm_parallel.kernels.custom_op   a backend's launchers as ``torch.library`` ops (torch.compile)
    fm_parallel.kernels.triton      the Triton kernels, their backend and the plans built on the GPU
    fm_parallel.kernels.fa4         FlashAttention-4's CuTe kernels: block lists, mask_mod, patches, pin

The language subpackages' sources live in the repository's top-level ``kernels/`` folder
(``kernels/triton``, ``kernels/fa4``); ``pyproject.toml`` installs them here. That folder has no
``__init__.py``: as a top-level name it is at most a namespace portion, which any installed regular
package of that name (PyPI's ``kernels``, which transformers imports) takes precedence over, wherever
Python starts. Nothing imports a top-level ``kernels`` (``tests/test_architecture.py``).

Adding a backend: ``docs/adding-a-backend.md``.
"""

from pathlib import Path as _Path

# A source checkout that is on sys.path but not installed (the GPU machine's PYTHONPATH): the language
# folders are found in the top-level kernels/ beside this package. Installed, they sit here already.
_here = _Path(__file__).resolve().parent
_source = _here.parents[1] / "kernels"
if not (_here / "triton").is_dir() and (_source / "triton" / "backend.py").is_file():
    __path__.append(str(_source))  # noqa: F821 (a package's __path__)
del _Path, _here, _source
