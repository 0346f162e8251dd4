"""The trainer's command line: ``python -m fm_parallel.launch`` (or ``launch/train.py``), in one of three ways.

    python launch/train.py --config launch/configs/cpu_sft.toml                       # one process
    python launch/train.py --nproc_per_node 2 --config launch/configs/cpu_sft.toml    # 2 ranks, launched here
    torchrun --nproc_per_node 2 launch/train.py --config launch/configs/cpu_sft.toml  # 2 ranks, launched by torchrun

``--nproc_per_node N`` checks the configuration in this process before any rank starts, then starts the N
ranks with torchrun's own launcher (``torch.distributed.run``, standalone rendezvous), keeping the
trainer's exit status: a user error is one ``error:`` line and status 2 (``fm_parallel.user_errors``:
how the line survives torchrun stopping the other ranks). Under a bare ``torchrun`` the ranks print
the same line, but torchrun reports any rank that exits non-zero as its own
``ChildFailedError`` (a traceback, status 1): that is torchrun's, and nothing a rank does changes it.

Threads: when ``OMP_NUM_THREADS`` is unset, each process gets ``cores // local processes`` intra-op
threads (torchrun sets 1 per rank when it starts several), said in one line.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["main", "threads_per_process"]

_LAUNCHED = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")  # set by torchrun (and by this launcher) in each rank


def _cores() -> int:
    """Cores this process may run on (taskset / cpuset aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process(local_processes: int, cores: int | None = None) -> int:
    """Intra-op threads for each of ``local_processes`` processes sharing this machine's cores: more
    threads than cores make OpenMP's threads wait for each other at every parallel region."""
    return max(1, (cores or _cores()) // max(1, local_processes))


def _split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """``--nproc_per_node N`` (or ``--nproc-per-node``, ``=N``) taken out of the trainer's arguments."""
    rest, nproc, i = [], None, 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name}: expected a number of processes after it")
                value, i = argv[i + 1], i + 1
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")
            nproc = int(value)
        else:
            rest.append(token)
        i += 1
    return nproc, rest


class _QuietUserErrors(logging.Filter):
    """torchrun's agent logs a rank's failure and the signal it sends the others; for a user error
    (status 2, its line already printed by rank 0) that is noise after the one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("exitcode: 2)" in message or "closing signal" in message)


def _launch(nproc: int, argv: list[str]) -> int:
    """Check the configuration here, then start ``nproc`` ranks of this command; the exit status."""
    from fm_parallel.trainer.config import check_before_start, load_config

    check_before_start(load_config(argv), nproc)  # a ConfigError ends it here, before any rank exists (caught by main)
    if "OMP_NUM_THREADS" not in os.environ:
        threads = threads_per_process(nproc)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # what each rank inherits (torchrun would print a banner)
        print(f"threads: {threads} per rank ({_cores()} cores / {nproc} ranks; set OMP_NUM_THREADS to choose)", flush=True)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = _QuietUserErrors()
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(quiet)
    args = torchrun.parse_args(["--standalone", "--nproc_per_node", str(nproc), "--module", "fm_parallel.launch", *argv])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        if 2 in codes.values():  # a user error: its line is printed (fm_parallel.user_errors)
            return 2
        rank, failure = e.get_first_failure()
        print(f"error: rank {rank} failed with exit code {failure.exitcode} (its output is above)", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # Ctrl-C or SIGTERM to this launcher: the ranks were stopped
        return 128 + int(e.sigval)
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    launched = any(k in os.environ for k in _LAUNCHED)
    try:
        nproc, argv = _split_nproc(argv)
        if nproc is not None and launched:
            raise ValueError("--nproc_per_node: expected it only outside torchrun (this process is already one of "
                             f"{os.environ.get('LOCAL_WORLD_SIZE', '?')} ranks)")
        if nproc is not None and nproc > 1:
            raise SystemExit(_launch(nproc, argv))
    except ValueError as e:  # the trainer's ConfigError is one
        if os.environ.get("FM_TRACEBACK"):
            raise
        from fm_parallel.user_errors import exit_with_user_error

        exit_with_user_error(e)
    if "OMP_NUM_THREADS" not in os.environ and "-h" not in argv and "--help" not in argv:
        import torch

        from fm_parallel.trainer.config import processes_on_this_host

        local = processes_on_this_host()
        threads = threads_per_process(local)
        torch.set_num_threads(threads)
        if os.environ.get("RANK", "0") == "0":
            policy = os.environ.get("OMP_WAIT_POLICY", "unset")
            print(f"threads: {threads} per process ({_cores()} cores / {local} local process{'es' if local > 1 else ''}; "
                  f"OMP_WAIT_POLICY {policy}; set OMP_NUM_THREADS to choose)", flush=True)
    from fm_parallel.trainer.loop import main as train

    train(argv)


if __name__ == "__main__":
    main()
