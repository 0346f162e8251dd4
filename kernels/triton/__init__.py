"""FlashMask in Triton (``impl="triton"``, any CUDA GPU; ``TRITON_INTERPRET=1`` on a CPU).

    kernels   the ``@triton.jit`` forward, dK/dV and dQ kernels, reading the bounds and a block plan
    backend   launchers, autograd and the backend entry ``attention(...)`` (fm_parallel/backends.py)
    plan      the launch plans (and FA4's block lists) built on the GPU for consecutive query rows
"""
