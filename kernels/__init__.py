"""GPU kernels, installed as ``fm_parallel.kernels`` (never as a top-level ``kernels`` package).

Each backend is a module here exposing ``attention(q, k, v, mask, positions, scale) -> (out, lse)``;
``fm_parallel.attention`` looks them up by name (``impl="triton"`` imports
``fm_parallel.kernels.triton``). A backend that is absent makes an explicit ``impl`` raise a clear
error and makes ``impl="auto"`` use the PyTorch path.
"""
