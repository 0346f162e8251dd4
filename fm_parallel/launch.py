"""``python -m fm_parallel.launch`` (or ``torchrun -m fm_parallel.launch``): the trainer, as launch/train.py."""

from fm_parallel.trainer.loop import main

if __name__ == "__main__":
    main()
