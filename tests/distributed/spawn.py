"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

Each rank's result (a JSON-able dict) is written to a file; a rank that raises records the error.
A run that does not finish in `timeout` seconds fails the test instead of hanging the suite.

`run_cases` runs several cases in one spawn (starting N interpreters that import torch costs more
than most cases): each case's outcome is kept apart, and a case that raises stops the ones after it
on every rank, so one failure is reported as itself, not as the next case's desynchronised
collectives.

The ranks are forked from a forkserver that has imported torch once (``forkserver``: a fresh process
of its own, never the test process, so no test's patches reach it): 0.06 s a 2-rank start instead of
1.4 s with ``spawn`` (measured here). Each rank takes the test process's environment and working
folder as they are at the call, as a spawned one would (a forkserver's children would otherwise
inherit the server's, fixed when it started). ``FM_TEST_START_METHOD=spawn`` goes back to spawn.
"""

import json
import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = os.environ.get("FM_TEST_START_METHOD", "forkserver" if os.name == "posix" else "spawn")
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(["torch", "torch.distributed"])


def _entry(rank, world, init_file, out_dir, fn, args, environ=None, cwd=None):
    if environ is not None:  # the caller's environment at the call, as a spawned rank gets it
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    except Exception as e:  # reported to the test, which decides whether it was expected
        result = {"exception": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    # Written under a temporary name and renamed: when another rank dies, torch.multiprocessing
    # SIGTERMs the rest, and a half-written file must read as "no result", not as broken JSON.
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240.0, allow_missing: bool = False) -> list[dict | None]:
    """Each rank's result; ``allow_missing``: a rank that wrote none (it died) gives None instead of failing."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(_entry, args=(world, init_file, tmp, fn, args, dict(os.environ), os.getcwd()),
                                 nprocs=world, join=False, start_method=START_METHOD)
        import time

        deadline = time.monotonic() + timeout
        teardown = None
        while True:
            try:
                if ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
                    break
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                # A rank that dies after writing its result died in teardown (seen rarely: DeepSpeed's
                # shared-memory comm aborting at exit, or a barrier whose peer died); its result still
                # counts. One that dies before writing it fails below, when its file is missing.
                teardown = str(e)
                for p in ctx.processes:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                break
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks did not finish within {timeout} s (a hang)")
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        missing = [r for r, path in enumerate(paths) if not os.path.exists(path)]
        if allow_missing:
            return [json.load(open(path)) if os.path.exists(path) else None for path in paths]
        if missing:
            # Every missing rank is named: the one that died first and any the harness then stopped.
            named = "; ".join(f"rank {r} wrote no result" for r in missing)
            raise RuntimeError(f"{named} ({teardown or 'no exit status'})")
        return [json.load(open(path)) for path in paths]


def raised(call) -> dict:
    """What ``call()`` raised on this rank (``{"raised": "Type: message"}``; ``None``: it returned), kept as
    a case's result so that a refusal expected on every rank does not stop the later cases of its spawn."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test checks what each rank raised
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"raised": None}


def _cases(rank, world, cases):
    """Each case in turn on this rank; after each, the ranks learn whether any raised and stop together."""
    out, failed = {}, None
    for key, (fn, args) in cases:
        if failed is not None:
            out[key] = {"exception": f"not run: case {failed} raised on some rank", "traceback": ""}
            continue
        try:
            out[key] = fn(rank, world, *args)
        except Exception as e:  # reported to that case's test
            out[key] = {"exception": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        raised = [None] * world
        dist.all_gather_object(raised, "exception" in out[key] and "traceback" in out[key])
        if any(raised):
            failed = key
    return out


def run_cases(world: int, cases: dict, timeout: float = 240.0) -> dict[str, list[dict]]:
    """``{key: (fn, args)}`` run in one spawn of ``world`` ranks, in order: ``{key: [each rank's fn(rank, world, *args)]}``.

    Keys are strings (results travel as JSON).

    A case's exception is its ranks' result (``exception``, ``traceback``) as with `run_ranks`; the
    cases after one that raised are not run (their result says which case stopped them). A case's fn
    must leave the process as it found it (restore what it patches) so the next case tests the same.
    """
    results = run_ranks(_cases, world, list(cases.items()), timeout=timeout)
    return {key: [res[key] for res in results] for key in cases}
