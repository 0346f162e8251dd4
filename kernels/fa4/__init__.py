"""FlashMask on FlashAttention-4's CuTe DSL kernels (``impl="cute"``, Hopper; the ``[cute]`` extra).

    pin              the FA4 version the lists and patches are written for, read from pyproject.toml
    sparsity         block-sparsity lists and the packed bounds FA4 takes (PyTorch; runs anywhere)
    mask_mod         the FlashMask predicate as a CuTe ``mask_mod``
    spec             which of our changes a traced kernel gets (no FA4 import)
    column_masking   change 1: partial tiles masked column by column
    cost_schedule    change 2: CTAs run heaviest block first
    patches          installs both into FA4, only for our ``mask_mod`` and only on the pinned version
    launches         FA4 calls replayed without FA4's Python
    backend          the backend entry ``attention(...)`` (fm_parallel/backends.py)

Only ``sparsity`` and ``pin`` import without FA4 installed.
"""
