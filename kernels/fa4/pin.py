"""The FlashAttention-4 version our block lists, ``mask_mod`` and patches are written for.

It is written once, in ``pyproject.toml``'s ``cute`` extra (``flash-attn-4==<version>``); this module
reads it there (a source checkout) or from the installed package's metadata, and every check (the
patches' install, the tests, the benchmarks) asks :func:`pinned_fa4`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

__all__ = ["FA4_DISTRIBUTION", "pinned_fa4"]

FA4_DISTRIBUTION = "flash-attn-4"
_PIN = re.compile(rf"^{re.escape(FA4_DISTRIBUTION)}\s*==\s*([^;\s\"']+)")


def _from_pyproject(path: Path) -> str | None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    extras = tomllib.loads(path.read_text()).get("project", {}).get("optional-dependencies", {})
    return next((m.group(1) for req in extras.get("cute", ()) if (m := _PIN.match(req))), None)


def _from_metadata() -> str | None:
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("fm_parallel") or []
    except PackageNotFoundError:
        return None
    return next((m.group(1) for req in reqs if (m := _PIN.match(req)) and "cute" in req), None)


@lru_cache(maxsize=None)
def pinned_fa4() -> str:
    """The pinned ``flash-attn-4`` version: the ``X`` of ``flash-attn-4==X`` in the ``cute`` extra."""
    for parent in Path(__file__).resolve().parents:
        project = parent / "pyproject.toml"
        if project.is_file() and (parent / "kernels" / "fa4").is_dir():
            found = _from_pyproject(project)
            break
    else:
        found = _from_metadata()
    if found is None:
        raise RuntimeError("pyproject.toml's cute extra pins no flash-attn-4==<version> (nor does the "
                           "installed fm_parallel's metadata)")
    return found
