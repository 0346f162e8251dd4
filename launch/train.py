"""The trainer's entry point: ``torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml``,
or ``python launch/train.py --nproc_per_node 2 ...`` (the config checked before any rank starts, the
trainer's exit status kept: fm_parallel/launch.py), or ``python launch/train.py ...`` for one process.

Options: ``--config FILE`` (TOML), ``--resume``, and any ``--section.key VALUE`` override; environment
overrides as ``FM_SECTION__KEY``. See fm_parallel/trainer/config.py for every field.
"""

import os

# Before torch loads OpenMP: threads that sleep at a barrier instead of spinning. Spinning threads on
# cores that other processes share wait for each other at every parallel region: 2 threads on 2 busy
# cores ran a cpu_sft step in 57-153 s, against 3-10 s with this (docs/training.md, "Threads").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fm_parallel.launch import main  # noqa: E402

if __name__ == "__main__":
    main()
