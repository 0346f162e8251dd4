"""Point-to-point pairing for ring schedules, and the cross-rank agreement check.

The ring here is a schedule of direct transfers: in step ``s`` rank ``r`` may send its own chunk to
``r + s`` and receive the chunk of ``r - s`` (mod P). Each step is a permutation, so the links are
loaded evenly as in a pass-along ring, and a chunk goes only to ranks that need it: nothing is
forwarded through ranks that would not use it.
"""

from __future__ import annotations

import collections
import numbers
import os
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from fm_parallel import backends
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["RingComm", "RankFailure", "check_agreement", "check_cp_inputs", "dtype_code", "device_code", "scale_code",
           "wait_with_deadline"]


class RingComm:
    """Owns the p2p pairing of one process group."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group)

    @property
    def capturable(self) -> bool:
        """Whether CUDA graphs can capture these transfers: NCCL's (stream-ordered device memory), not
        gloo's host-staged ones."""
        return self.backend == "nccl"

    def peer(self, group_rank: int) -> int:
        """Global rank of a rank of the group (p2p ops take global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def send_to(self, step: int) -> int:
        return (self.rank + step) % self.world_size

    def recv_from(self, step: int) -> int:
        return (self.rank - step) % self.world_size

    def exchange(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> "Pending":
        """Post isend/irecv for (tensor, group rank) pairs; returns what :meth:`wait` takes.

        On gloo, GPU tensors travel through host copies (gloo moves host memory): the sends are
        copied to the host here, the receives land in host buffers copied to the device by
        :meth:`wait`. That lets P processes that share one GPU run the real ring
        (``tests/gpu/multi_gpu.py --shared-gpu``); NCCL moves device memory directly."""
        copies = []
        if self.host_staged(sends, recvs):
            sends = [(t.to("cpu"), r) for t, r in sends]
            staged = []
            for t, r in recvs:
                host = torch.empty(t.shape, dtype=t.dtype)
                copies.append((host, t))
                staged.append((host, r))
            recvs = staged
        ops = [dist.P2POp(dist.isend, t, self.peer(r), self.group) for t, r in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peer(r), self.group) for t, r in recvs]
        return Pending(dist.batch_isend_irecv(ops) if ops else [], copies)

    def host_staged(self, sends, recvs) -> bool:
        return dist.get_backend(self.group) == "gloo" and any(t.device.type != "cpu" for t, _ in (*sends, *recvs))

    def wait(self, pending: "Pending") -> None:
        """Wait for posted transfers. On gloo (host transfers, a blocking wait anyway) with the
        agreement's deadline, so a peer that stops after the agreement is a :class:`RankFailure`, not a
        hang; on NCCL a plain wait, which keeps compute and transfers overlapped (the process group's
        own timeout and watchdog bound it)."""
        if dist.get_backend(self.group) != "gloo":
            for req in pending.works:
                req.wait()
        else:
            wait_with_deadline(pending.works, "context-parallel transfer", AGREEMENT_TIMEOUT_S)
        for host, device in pending.copies:
            device.copy_(host)


class Pending:
    """Posted transfers: their works, and host buffers to copy to the device once they are done."""

    __slots__ = ("works", "copies")

    def __init__(self, works: list, copies: list):
        self.works, self.copies = works, copies


# Works waited for with a deadline (agreements on any backend; gloo's ring and Ulysses transfers), kept
# referenced from Python a while longer (hold_works): the last two waits' (an agreement's few integers,
# or one transfer's host buffers), so what is held stays small.
_HELD_WORKS: collections.deque = collections.deque(maxlen=2)


def hold_works(works) -> None:
    """Keep finished ``works`` referenced from Python until later calls push them out (or the
    interpreter clears this module). A gloo work holds the tensors it moved; if the worker thread that
    ran it drops the last reference, it frees them there, which takes the GIL, and when that falls
    in the interpreter's shutdown the thread is cancelled inside a destructor: ``terminate called
    without an active exception``, SIGABRT, after the job's work was done (1 run in 5 of a 2-rank
    gloo script whose last collective was an agreement; core dump: ``~AsyncAllgatherWork`` in
    ``ProcessGroupGloo::runLoop``, pytorch/pytorch#179291). Held here, the last reference is
    Python's, dropped on the main thread. NCCL's ring transfers (device memory, their works released
    by its watchdog) are not held."""
    _HELD_WORKS.append(list(works))


def wait_with_deadline(works, what: str, timeout_s: float) -> None:
    """Wait for collective or p2p works, each for at most ``timeout_s``; a timeout or a closed peer
    connection becomes a :class:`RankFailure` saying ``what`` was waiting. The works are then held
    (:func:`hold_works`)."""
    hold_works(works)
    try:
        for work in works:
            try:
                work.wait(timeout=timedelta(seconds=timeout_s))
            except TypeError:  # a backend whose wait takes no deadline: the group's own timeout applies
                work.wait()
    except RuntimeError as e:  # gloo / NCCL: timed out, or a peer closed its connection
        raise RankFailure(f"{what}: a peer did not answer within {timeout_s:g} s or closed its connection (a rank "
                          f"died, stopped early, or is stuck elsewhere; FM_AGREEMENT_TIMEOUT_S sets the deadline): "
                          f"{str(e)[:300]}") from None


# Codes for values that are not ints, so that they travel in the agreement's int64 row.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "privateuseone")
_MESSAGE_BYTES = 1024
# How long a rank waits for its peers at an agreement or a gloo transfer before a RankFailure. Every
# attention call agrees, so this bounds what a user waits when a peer died, stopped or went its own
# way: a minute, not the ten of torch's default. A peer that is merely slower (a first-call kernel
# compilation, a checkpoint written by one rank between steps) must arrive within it;
# FM_AGREEMENT_TIMEOUT_S raises it for jobs where that takes longer.
AGREEMENT_TIMEOUT_S = float(os.environ.get("FM_AGREEMENT_TIMEOUT_S", "60"))


class RankFailure(RuntimeError):
    """A peer never reached a collective (it died, stopped early, or is stuck elsewhere)."""


def dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def device_code(device) -> int:
    kind = torch.device(device).type
    return _DEVICE_TYPES.index(kind) + 1 if kind in _DEVICE_TYPES else 0


def scale_code(scale) -> int:
    """``scale`` as the int64 of its float64 bits (None, the default ``1 / sqrt(D)``: -1, a NaN's bits)."""
    return -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _shown(name: str, code: int) -> str:
    if name == "impl":
        return backends.names()[code - 1] if 0 < code <= len(backends.names()) else "?"
    if name == "scale":
        return "default" if code == -1 else repr(struct.unpack("<d", struct.pack("<q", code))[0])
    if name == "gradients":
        return "needed" if code else "none"
    if name.endswith("dtype"):
        return str(_DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(_DTYPES) else "?"
    if name.endswith("device type"):
        return _DEVICE_TYPES[code - 1] if 0 < code <= len(_DEVICE_TYPES) else "?"
    return str(code)


def _gather(row: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
    """All-gather one small tensor with a deadline: ``[world, *row.shape]`` on the CPU."""
    if not _host_capable(group):  # an NCCL-only group moves device memory (a device round trip)
        row = row.cuda()
    out = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    try:
        works = [dist.all_gather(out, row, group=group, async_op=True)]
    except RuntimeError as e:  # a peer already gone when the gather is posted
        raise RankFailure(f"ranks' agreement check: a peer closed its connection (a rank died): {str(e)[:300]}") from None
    wait_with_deadline(works, "ranks' agreement check", timeout_s)
    return torch.stack(out).cpu()


_HOST_CAPABLE: dict = {}


def _host_capable(group) -> bool:
    """Whether ``group`` moves host tensors: gloo, or a group made with a CPU backend beside NCCL
    (``init_process_group("cpu:gloo,cuda:nccl")``), where the per-call agreement then needs no
    device synchronisation."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    key = (id(pg), dist.get_backend(group))
    if key not in _HOST_CAPABLE:
        if key[1] == "gloo":
            _HOST_CAPABLE[key] = True
        else:
            try:
                pg._get_backend(torch.device("cpu"))
                _HOST_CAPABLE[key] = True
            except (RuntimeError, AttributeError):
                _HOST_CAPABLE[key] = False
    return _HOST_CAPABLE[key]


def _encode(message: str) -> torch.Tensor:
    data = message.encode("utf-8")[:_MESSAGE_BYTES]
    return torch.tensor(list(data) + [0] * (_MESSAGE_BYTES - len(data)), dtype=torch.uint8)


def _decode(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode("utf-8", errors="replace")


def _exchange(values: list[int], names: list[str], group, problem: str | None, timeout_s: float) -> str | None:
    """One stage of :func:`check_agreement`: the message every rank of ``group`` will raise, or None."""
    row = torch.tensor([1 if problem else 0] + ([0] * len(values) if problem else [int(x) for x in values]), dtype=torch.int64)
    table = _gather(row, group, timeout_s)
    failed = torch.nonzero(table[:, 0]).flatten().tolist()
    if failed:  # every rank takes part in the second gather, so every rank raises the same error
        messages = _gather(_encode(problem or ""), group, timeout_s)
        return _decode(messages[failed[0]])
    for i, name in enumerate(names):
        column = table[:, i + 1]
        if not bool((column == column[0]).all()):
            shown = [_shown(name, int(c)) for c in column]
            if name in ("mask", "plan"):
                shown = ["same as rank 0" if int(c) == int(column[0]) else "different" for c in column]
            return f"{name}: expected the same value on every rank, got {shown} (by rank)"
    return None


def check_agreement(values: list[int], names: list[str], group=None, *, problem: str | None = None,
                    groups: list | None = None, timeout_s: float | None = None) -> None:
    """All ranks compare ``values``; every rank raises the same ValueError when they differ.

    Args:
        values: ints (use :func:`dtype_code` / :func:`device_code` for dtypes and devices, digests for masks).
        names: one per value, for the error.
        problem: this rank's own check failed with this message; it still takes part, so its peers
            raise the same error instead of blocking in a collective it never joins.
        groups: compare over several groups in turn (hybrid: Ulysses then ring), carrying a failure on.
        timeout_s: deadline for a peer to arrive (default ``FM_AGREEMENT_TIMEOUT_S``, 60 s); a dead
            or absent peer raises :class:`RankFailure` instead of a hang.
    """
    timeout_s = AGREEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    message = None
    if problem is not None:
        message = f"rank {dist.get_rank()}: {problem}"
    for g in (groups if groups is not None else [group]):
        message = _exchange(values, names, g, message, timeout_s) or message
    if message:
        raise ValueError(message)


def _local_problem(q, k, v, mask, plan, world) -> str | None:
    """This rank's own checks, before the agreement (a message, or None)."""
    if not isinstance(plan, ShardPlan) or plan.world_size != world:
        got = plan.world_size if isinstance(plan, ShardPlan) else type(plan).__name__
        return f"plan: expected a ShardPlan for the group's {world} ranks, got {got}"
    if not isinstance(mask, FlashMask) or mask.num_keys != plan.num_tokens:
        got = mask.num_keys if isinstance(mask, FlashMask) else type(mask).__name__
        return f"mask: expected a FlashMask with {plan.num_tokens} key columns (the plan's N), got {got}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name}: expected a [B, H, N/P, D] tensor, got {getattr(t, 'shape', type(t).__name__)}"
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    if n_local != plan.local_tokens or k.shape[2] != n_local or v.shape[2] != n_local:
        return f"q, k, v: expected {plan.local_tokens} local tokens (N / P), got {n_local}, {k.shape[2]}, {v.shape[2]}"
    if k.shape[:2] != v.shape[:2] or k.shape[0] != b or k.shape[-1] != d:
        return f"k, v: expected [B={b}, H_kv, N/P, D={d}] alike, got {tuple(k.shape)} and {tuple(v.shape)}"
    if hkv < 1 or hq % hkv:
        return f"k: expected a number of heads dividing q's {hq}, got {hkv}"
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return f"q, k, v: expected one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}"
    if mask.device != q.device:
        return f"mask: expected device {q.device} like q, got {mask.device}"
    if mask.batch not in (1, b) or mask.heads not in (1, hkv, hq):
        return f"mask: expected batch 1 or {b} and 1, {hkv} or {hq} heads, got {mask.batch} and {mask.heads}"
    return None


def check_cp_inputs(q, k, v, mask, plan, group, *, groups: list | None = None, world: int | None = None,
                    problem: str | None = None, impl: str | None = "auto", chunked: bool = False,
                    scale: float | None = None) -> tuple[int, int, str | None]:
    """The checks every context-parallel attention call makes, on every call; returns ``(world, rank,
    backend name)``.

    Every rank runs its own checks and resolves ``impl`` (the one resolver, :mod:`fm_parallel.backends`,
    ``chunked`` for the ring), then all ranks agree in one small all-gather of a few integers on
    everything that makes their calls meet: the shapes, dtype, device type, the kernel, the scale,
    whether a backward will follow, the mask (a cryptographic digest of its bounds, cached per mask)
    and the plan. A rank whose own check failed still joins, so the same ValueError is raised on every
    rank instead of a hang; and since every call agrees, a rank that changes any of these at a later
    layer, alone, is caught there too. ``groups``: agree over these groups in turn instead of ``group``
    alone, with ``world`` the ranks the plan spans (hybrid: Ulysses then ring groups, R x U ranks).
    ``problem``: a failure the caller found itself, raised on every rank like the others.
    """
    if not dist.is_initialized():
        raise ValueError("group: expected an initialised torch.distributed process group, got none")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group) if world is None else world
    problem = problem or _local_problem(q, k, v, mask, plan, world)
    name = None
    if problem is None and scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        problem = f"scale: expected a float or None, got {scale!r}"
    if problem is None:
        try:  # before any collective: an unknown or unavailable name on one rank fails on all of them
            name = backends.resolve(impl, q.device, q.dtype, q.shape[-1], v.shape[-1], chunked=chunked)
        except ValueError as e:
            problem = str(e)
    names = ["q length", "k length", "batch", "query heads", "kv heads", "head dim", "value dim", "plan tokens",
             "dtype", "device type", "impl", "scale", "gradients", "mask", "plan"]
    values = [0] * len(names)
    if problem is None:
        b, hq, n_local, d = q.shape
        # A backward follows on this rank: its transfers (ring) or all-to-alls (Ulysses) need every peer's.
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        values = [n_local, k.shape[2], b, q.shape[1], k.shape[1], d, v.shape[-1], plan.num_tokens,
                  dtype_code(q.dtype), device_code(q.device), backends.names().index(name) + 1, scale_code(scale),
                  int(grads), mask.digest(), plan.digest()]
    check_agreement(values, names, group, problem=problem, groups=groups)
    return world, rank, name
