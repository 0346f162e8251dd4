"""How a process ends on a user error (a bad configuration, data or folder; ranks that disagree): one
``error: ...`` line on stderr and exit status 2, no traceback, also when it is one of several ranks.

Under torchrun the first rank to exit makes the agent stop the others (SIGTERM). So a line printed
only by rank 0 is lost whenever another rank reaches the error first and rank 0 is stopped before it
prints: the user then sees torchrun's report and no reason (seen on CI: two ranks refusing the same
missing logger package, rank 1 first). And an error that only one rank meets (its own data shard,
its own device) must be printed by that rank.

So rank 0 prints at once and exits; any other rank waits :data:`PEER_GRACE_S` first (time for rank 0,
checking the same configuration, to print the same error and end the job, which stops this rank
quietly), then prints its own line, naming its rank, and exits. The reason is always shown, once in
the common case, and the wait is bounded: no rank hangs on a peer.
"""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

__all__ = ["PEER_GRACE_S", "exit_with_user_error", "user_error_line"]

# Seconds a rank other than 0 waits before printing its error and exiting. Ranks of one job start
# within a second or two of each other and check the same configuration; 5 s covers that on a
# loaded machine and costs a failing job no more.
PEER_GRACE_S = 5.0


def _rank_and_world(environ) -> tuple[int, int]:
    try:
        return int(environ.get("RANK", "0") or 0), int(environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 0, 1


def user_error_line(error: BaseException | str, environ=None) -> str:
    """The line to print: ``error: <message>``, or ``error (rank k): <message>`` on a rank other than
    0 of a job of several."""
    rank, world = _rank_and_world(os.environ if environ is None else environ)
    return f"error (rank {rank}): {error}" if rank and world > 1 else f"error: {error}"


def exit_with_user_error(error: BaseException | str, grace_s: float | None = None) -> NoReturn:
    """Print :func:`user_error_line` (through tqdm, so never glued to a progress bar) and exit with
    status 2; on a rank other than 0 of several, after waiting ``grace_s`` (default
    :data:`PEER_GRACE_S`) for rank 0 to report the same error first (the module's docstring)."""
    rank, world = _rank_and_world(os.environ)
    if rank and world > 1:
        time.sleep(PEER_GRACE_S if grace_s is None else grace_s)
    from tqdm import tqdm

    tqdm.write(user_error_line(error), file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(2)
