"""The backend registry: every local attention implementation by name, and the one resolver that
``flashmask_attention``, the ring, Ulysses, hybrid, the Hugging Face backend and the trainer use.

A backend is one module (imported on first use, so optional packages stay optional) with

    forward(q, k, v, mask, positions, scale, q_offset=None) -> out [B, Hq, Nq, Dv], lse [B, Hq, Nq] float32
    backward(q, k, v, out, lse, dout, mask, positions, scale, dlse=None, q_offset=None, deterministic=...) -> dq, dk, dv
    attention(q, k, v, mask, positions, scale, q_offset=None, deterministic=...) -> (out, lse), differentiable

and optionally ``supports(device) -> bool`` and ``unsupported_inputs(dtype, head_dim, value_dim) -> str | None``.
``q_offset``: the rows are ``q_offset + arange(Nq)`` (launch plans are then cached per mask, in the backend's own store: ``fm_parallel.derived``;
None: arbitrary ``positions``). Adding a backend is one module and one :func:`register` line
(docs/adding-a-backend.md).

``auto`` means the same at every entry point: on CUDA the first of :data:`AUTO_ORDER_CUDA` that is
installed, runs on the device and takes the dtype and head dims (CuTe on Hopper with the ``[cute]``
extra, else Triton), otherwise the PyTorch path. An explicit name is honoured or raises a
ValueError saying why; an unknown name raises.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

__all__ = ["Backend", "register", "get", "resolve", "names", "AUTO_ORDER_CUDA"]

log = logging.getLogger("fm_parallel")


@dataclass(frozen=True)
class Backend:
    """One local implementation.

    Attributes:
        name: what ``impl=`` says.
        module: import path of the implementation (see the module docstring for what it exposes).
        package: the optional distribution it needs (None: always importable); an installed package
            whose module fails to import is reported once instead of skipped silently.
        deterministic: its backward is reproducible bit for bit.
        gpu: it needs CUDA tensors (Triton also runs on CPU tensors under ``TRITON_INTERPRET=1``).
        chunked: it has ``forward`` / ``backward`` launchers the ring can call per key chunk
            (``dense`` has not: it runs only where the whole mask is local).
        requirement: what to say when the device is refused (``supports`` returned False).
    """

    name: str
    module: str
    package: str | None
    deterministic: bool
    gpu: bool
    chunked: bool = True
    requirement: str = ""

    def load(self):
        """The imported module, or a ValueError saying why it cannot run."""
        if self.name not in _LOADED:
            try:
                _LOADED[self.name] = importlib.import_module(self.module)
            except ImportError as e:
                raise ValueError(f"impl: {self.name!r} is not available here ({e}); use impl='auto' or 'torch'") from None
        return _LOADED[self.name]

    def runs_on(self, device: torch.device) -> bool:
        # The Triton interpreter (TRITON_INTERPRET=1, CPU tests) runs the Triton kernels on CPU tensors.
        if not self.gpu:
            return True
        return device.type == "cuda" or (self.name == "triton" and os.environ.get("TRITON_INTERPRET") == "1")

    def unsupported(self, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None,
                    value_dim: int | None = None) -> str | None:
        """Why this backend cannot run here (device, dtype, head dims), or None. Imports the module."""
        if not self.runs_on(device):
            return f"impl: {self.name!r} needs CUDA tensors, got device {device}"
        module = self.load()
        if not getattr(module, "supports", lambda _: True)(device):
            return f"impl: {self.name!r} does not run on {_device_name(device)}{self.requirement}"
        check = getattr(module, "unsupported_inputs", None)
        if check is not None and dtype is not None:
            return check(dtype, head_dim, value_dim if value_dim is not None else head_dim)
        return None

    # The launchers, looked up on each call: a dict lookup once loaded.
    def forward(self, *args, **kwargs):
        return self.load().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return self.load().backward(*args, **kwargs)

    def attention(self, *args, **kwargs):
        return self.load().attention(*args, **kwargs)


_REGISTRY: dict[str, Backend] = {}
_LOADED: dict = {}  # backend name -> imported module
_logged: set[str] = set()
# What impl="auto" tries on CUDA, in order. "cute" passed tests/gpu/test_kernels.py on the H200 (every
# family, GQA, D 64-256, fp16, ring chunks, zigzag rows, lse gradients) and under context parallelism
# (tests/gpu/multi_gpu.py --shared-gpu, 144/144); it is the faster backend there (docs/benchmarks/README.md) and is
# skipped when a reproducible backward is required.
AUTO_ORDER_CUDA = ("cute", "triton")


def register(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend
    _LOADED.pop(backend.name, None)


def names() -> tuple[str, ...]:
    """Every name ``impl=`` accepts, ``"auto"`` first."""
    return ("auto", *_REGISTRY)


def get(name: str) -> Backend:
    """The registered backend ``name`` (a resolved name: ``auto`` is not one)."""
    if name not in _REGISTRY:
        raise ValueError(f"impl: expected one of {names()}, got {name!r}")
    return _REGISTRY[name]


register(Backend("cute", "fm_parallel.kernels.fa4.backend", "flash_attn", deterministic=False, gpu=True,
                 requirement=" (impl='cute' needs a Hopper GPU, compute capability 9.x); use impl='triton'"))
register(Backend("triton", "fm_parallel.kernels.triton.backend", "triton", deterministic=True, gpu=True))
register(Backend("torch", "fm_parallel.reference", None, deterministic=True, gpu=False))
register(Backend("dense", "fm_parallel.dense", None, deterministic=True, gpu=False, chunked=False))


def _device_name(device: torch.device) -> str:
    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):
        return str(device)


def log_once(key: str, message: str) -> None:
    """A warning on the ``fm_parallel`` logger, once per ``key`` (auto skipping a broken backend, the dense fallback)."""
    if key not in _logged:
        _logged.add(key)
        log.warning(message)


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without its ``import torch._dynamo`` (1.1 s of every
    interpreter that imports fm_parallel, each spawned rank's too, where nothing is compiled): the
    same mark torch's decorator sets (tests/test_backends.py checks that they agree)."""
    fn._dynamo_marked_constant = True
    return fn


# Under torch.compile the choice is made once while tracing and baked into the graph (it depends only
# on the requested name, the device, the dtype / dims and the installed packages).
@_assume_constant_result
def resolve(impl: str | None, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None,
            value_dim: int | None = None, deterministic: bool = False, chunked: bool = False) -> str:
    """The backend name ``impl`` means for tensors on ``device`` (of ``dtype`` and head dims, when given).

    Args:
        impl: a registered name, ``"auto"``, or None (= ``"auto"``).
        deterministic: a reproducible backward is required (auto skips backends without one; an
            explicit one raises).
        chunked: the caller runs the backend per key chunk (the ring): backends without launchers
            (``dense``) raise.
    Raises:
        ValueError: unknown name, or an explicit backend that cannot run these inputs (saying why).
    """
    if impl is None:
        impl = "auto"
    if not isinstance(impl, str) or (impl != "auto" and impl not in _REGISTRY):
        raise ValueError(f"impl: expected one of {names()}, got {impl!r}")
    if impl != "auto":
        backend = _REGISTRY[impl]
        if deterministic and not backend.deterministic:
            raise ValueError(f"deterministic: impl={impl!r} has no reproducible backward (FA4 adds dQ with atomics on "
                             "Hopper); use impl='triton' or 'auto', or deterministic=False")
        if chunked and not backend.chunked:
            raise ValueError(f"impl: {impl!r} runs only where the whole mask is local (flashmask_attention, Ulysses), "
                             "not per ring chunk; use 'auto', 'cute', 'triton' or 'torch'")
        why = backend.unsupported(device, dtype, head_dim, value_dim)
        if why:
            raise ValueError(why)
        return impl
    if device.type == "cuda":
        for name in AUTO_ORDER_CUDA:
            backend = _REGISTRY.get(name)
            if backend is None or (deterministic and not backend.deterministic):
                continue
            try:
                if backend.unsupported(device, dtype, head_dim, value_dim) is None:
                    return name
            except ValueError as e:
                # Not installed: auto skips it by design. Installed but broken (a missing library of FA4's,
                # say): said once, or auto would fall back to a slower backend silently.
                if backend.package and importlib.util.find_spec(backend.package) is not None:
                    log_once(f"broken:{name}", f"fm_parallel: impl='auto' skips {name!r}, which is installed but "
                                                f"does not load ({e}); using the next backend")
    return "torch"
