"""GPU kernels, installed as ``fm_parallel.kernels`` (never as a top-level ``kernels`` package).

Each backend is a module here (``triton_flashmask``, ``cute_flashmask``) exposing ``forward``,
``backward`` and ``attention(q, k, v, mask, positions, scale, ...) -> (out, lse)``, registered by name
in ``fm_parallel/backends.py`` (``impl="triton"`` imports ``fm_parallel.kernels.triton_flashmask``) and
imported on first use. A backend that cannot load makes an explicit ``impl`` raise a clear error; under
``impl="auto"`` the next backend runs (said once when the backend is installed but broken).

Why the guard below: this folder is the source of ``fm_parallel.kernels`` (``[tool.setuptools.package-dir]``),
and it sits at the project root. Whenever the root is on ``sys.path`` (pytest, ``python -c`` or a
notebook started there, ``python -m`` from the root), Python finds this folder first under the bare
name ``kernels`` and would shadow PyPI's popular ``kernels`` package, which transformers imports.
So when this file runs as a top-level ``kernels``, it hands the import on: it loads the first
``kernels`` found on ``sys.path`` outside the folder that holds this one (PyPI's, when installed) in
its place. Without one, it leaves an empty shell that looks like what it is, nothing installed:
no ``__file__``, ``__path__`` or ``__version__`` (so ``kernels.plan`` is not importable, and
transformers' probe, which finds this folder with ``find_spec`` and then imports it, reads it as a
stray namespace folder and reports ``kernels`` unavailable instead of crashing), and every name taken
from it raises ``ModuleNotFoundError`` (dunder probes get ``AttributeError``). Our sources are never importable as ``kernels``.
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
        def __getattr__(name):
            if name.startswith("__"):  # getattr(kernels, "__version__", default) is a probe: answer it
                raise AttributeError(f"module 'kernels' has no attribute {name!r}", name=name)
            raise ModuleNotFoundError(
                f"No module named 'kernels' (asked for kernels.{name}; the project folder kernels/ is "
                "fm_parallel.kernels, never a top-level package; PyPI's `kernels` is not installed)",
                name="kernels",
            )

        for _name in ("__file__", "__path__", "__cached__"):
            globals().pop(_name, None)
        for _name in ("_machinery", "_util", "_os", "_sys", "_root", "_elsewhere", "_spec", "_name"):
            globals().pop(_name, None)
    else:
        _module = _util.module_from_spec(_spec)
        # The import system returns sys.modules["kernels"] once this file has run: the real
        # package takes this module's place there before its own code runs (as a normal import would).
        _sys.modules["kernels"] = _module
        try:
            _spec.loader.exec_module(_module)
        except BaseException:
            _sys.modules.pop("kernels", None)
            raise
