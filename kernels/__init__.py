"""GPU kernels, installed as ``fm_parallel.kernels`` (never as a top-level ``kernels`` package).

Each backend is a module here exposing ``attention(q, k, v, mask, positions, scale) -> (out, lse)``;
``fm_parallel.attention`` looks them up by name (``impl="triton"`` imports
``fm_parallel.kernels.triton``). A backend that is absent makes an explicit ``impl`` raise a clear
error and makes ``impl="auto"`` use the PyTorch path.

Why the guard below: this folder is the source of ``fm_parallel.kernels`` (``[tool.setuptools.package-dir]``),
and it sits at the project root. Whenever the root is on ``sys.path`` (pytest, ``python -c`` or a
notebook started there, ``python -m`` from the root), Python finds this folder first under the bare
name ``kernels`` and would shadow PyPI's popular ``kernels`` package, which transformers imports.
So when this file runs as a top-level ``kernels``, it hands the import on: it loads the first
``kernels`` found on ``sys.path`` outside the folder that holds this one (PyPI's, when installed) in
its place, or fails as a missing module would. Our sources are never importable as ``kernels``.
"""

if __name__ == "kernels":  # imported as a top-level package, not as fm_parallel.kernels
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _elsewhere = [
        entry for entry in _sys.path
        if _os.path.realpath(_os.path.abspath(entry or _os.getcwd())) != _root
    ]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (the project folder kernels/ is fm_parallel.kernels, "
            "never a top-level package)",
            name="kernels",
        )
    _module = _util.module_from_spec(_spec)
    # The import system returns sys.modules["kernels"] once this file has run: the real
    # package takes this module's place there before its own code runs (as a normal import would).
    _sys.modules["kernels"] = _module
    try:
        _spec.loader.exec_module(_module)
    except BaseException:
        _sys.modules.pop("kernels", None)
        raise
