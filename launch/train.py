"""The trainer's entry point: ``torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml``.

Options: ``--config FILE`` (TOML), ``--resume``, and any ``--section.key VALUE`` override; environment
overrides as ``FM_SECTION__KEY``. See fm_parallel/trainer/config.py for every field.
"""

from fm_parallel.trainer.loop import main

if __name__ == "__main__":
    main()
