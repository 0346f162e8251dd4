"""Ring attention for any FlashMask, with transfers skipped exactly where no visible pair needs them.

Every rank holds the tokens listed by a :class:`ShardPlan` and the full O(N) mask. From the mask
and the plan all ranks compute the same exact table of visible pairs between rank r's queries and
rank j's keys (:func:`pair_counts`); in step ``s`` rank r receives the K/V chunk of ``r - s`` only if
its entry is non-zero, and that rank sends it only then, and only the window of its keys that r's
queries see (the first to the last such key, :meth:`PreparedMask.key_window`). The local kernel runs
per received chunk on the rows that see it, with the chunk's mask columns; partial results merge
through the log-sum-exp. The next step's receive is posted before the current chunk is computed.

Backward (own autograd, like ring-flash-attn): K/V travel again, each rank computes dQ locally and
the dK/dV of every chunk (key window) it used, and sends those back to the chunk's owner, again only
where the table says the pair exists.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from fm_parallel import backends
from fm_parallel.distributed.merge import merge_into
from fm_parallel.distributed.prepared import PreparedMask, for_call
from fm_parallel.distributed.sharding import ShardPlan
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["ring_attention", "RingStats", "ring_attention_over", "ring_agreed"]


@dataclass
class RingStats:
    """What one call did on this rank (forward and backward together)."""

    transfers_posted: int = 0  # chunks this rank sent (K/V forward, K/V and dK/dV backward)
    transfers_skipped: int = 0  # chunks a plain ring would have sent that this rank did not
    bytes_sent: int = 0
    visible_pairs: int = 0  # (query, key) pairs of this rank's queries, per mask row


class _Ring:
    """State shared by the forward and backward of one call; the step's derived data lives in ``prepared``."""

    def __init__(self, prepared: PreparedMask, comm, scale, backend, stats):
        self.prepared, self.scale, self.backend, self.stats = prepared, scale, backend, stats
        self.comm = comm  # RingComm, or a one-process stand-in (ring_attention_over)
        self.needed = prepared.needed  # needed[r][j]: rank r's queries see rank j's keys
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.graphs = prepared.graphs  # LayerGraphs when the step asked for CUDA graphs
        if self.graphs is not None and not getattr(comm, "capturable", False):
            raise ValueError("cuda_graphs: expected a transport CUDA graphs can capture (NCCL), got "
                             f"{getattr(comm, 'backend', type(comm).__name__)}; prepare the mask without cuda_graphs")

    def run(self, phase: str, fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(self, *inputs)``: eagerly, or through the step's CUDA graphs (:mod:`.graphs`)."""
        if self.graphs is None:
            return fn(self, *inputs)
        key = (self.scale, id(self.backend), id(self.comm), self.rank)
        return self.graphs.run(phase, lambda *t: fn(self._counting(t[-1]), *t[:-1]), inputs, key, self.stats, RingStats)

    def _counting(self, stats) -> "_Ring":
        """This ring counting into ``stats`` (a capture counts one run's transfers apart)."""
        ring = copy.copy(self)
        ring.stats = stats
        return ring

    def launch_args(self, source: int) -> tuple[slice, dict]:
        """The rows of this rank that see ``source``'s keys (a slice of the local rows) and the launcher
        arguments for them: the chunk's column mask in local rows, which are consecutive, so the kernels
        take their consecutive-row paths and cache their launch plans on that mask (made once per step
        by the prepared mask)."""
        p = self.prepared
        r0, r1 = p.window(source)
        return slice(r0, r1), dict(mask=p.columns(source), positions=p.local_rows[r0:r1], q_offset=r0)

    def sources(self) -> list[int]:
        """The ranks whose keys this rank's queries see."""
        return [s for s in range(self.world) if self.needed[self.rank][s]]

    def users(self) -> list[int]:
        """The ranks whose queries see this rank's keys."""
        return [d for d in range(self.world) if self.needed[d][self.rank]]

    def post_kv(self, step: int, k: torch.Tensor, v: torch.Tensor):
        """Send my K/V to ``rank + step`` if it needs them (the window it sees); receive ``rank - step``'s
        if I do."""
        dst, src = self.comm.send_to(step), self.comm.recv_from(step)
        sends = []
        if self.needed[dst][self.rank]:
            window = self.prepared.sent_window(dst)
            sends = [(_keys(k, window, contiguous=True), dst), (_keys(v, window, contiguous=True), dst)]
        bufs = _buffers(k, v, self.prepared.key_window(src)) if self.needed[self.rank][src] else None
        recvs = [(bufs[0], src), (bufs[1], src)] if bufs else []
        self._count(sends, skipped=0 if sends else 1)
        return self.comm.exchange(sends, recvs), bufs

    def kv_chunks(self, k: torch.Tensor, v: torch.Tensor):
        """Yield ``(step, source rank, (k, v) or None)`` for every step, my own chunk first.

        The transfer of step s + 1 is posted before step s's chunk is handed out (and so before it
        is computed), overlapping communication with the local kernel.
        """
        pending = self.post_kv(1, k, v) if self.world > 1 else None
        for step in range(self.world):
            if step == 0:
                # (a copy when the own window is partial, rare: the kernels then take the same dense
                # layout as a received chunk)
                window = self.prepared.key_window(self.rank)
                chunk = ((_keys(k, window, contiguous=True), _keys(v, window, contiguous=True))
                         if self.needed[self.rank][self.rank] else None)
            else:
                reqs, chunk = pending
                pending = self.post_kv(step + 1, k, v) if step + 1 < self.world else None
                self.comm.wait(reqs)
            yield step, self.comm.recv_from(step), chunk

    def _count(self, sends, skipped: int) -> None:
        if self.stats is None:
            return
        self.stats.transfers_posted += 1 if sends else 0
        self.stats.transfers_skipped += skipped
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)


def _keys(t: torch.Tensor, window: tuple[int, int], contiguous: bool = False) -> torch.Tensor:
    """``t[:, :, c0:c1]`` for ``window = (c0, c1)``: ``t`` itself when the window is all of it."""
    c0, c1 = window
    if (c0, c1) == (0, t.shape[2]):
        return t
    part = t[:, :, c0:c1]
    return part.contiguous() if contiguous else part


def _buffers(k: torch.Tensor, v: torch.Tensor, window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive buffers for a key window of ``k`` / ``v``'s kind (another rank's, or gradients of mine)."""
    n = window[1] - window[0]
    return (k.new_empty(*k.shape[:2], n, k.shape[3]), v.new_empty(*v.shape[:2], n, v.shape[3]))


def _spans(windows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(a, b, parts)``: the disjoint row spans that the (possibly overlapping) ``windows`` cover, each
    with the number of windows in it. Empty windows are left out."""
    spans: list[list[int]] = []
    for a, b in sorted(w for w in windows if w[1] > w[0]):
        if spans and a < spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
            spans[-1][2] += 1
        else:
            spans.append([a, b, 1])
    return [tuple(x) for x in spans]


def _span_of(spans: list[tuple[int, int, int]], rows: slice) -> tuple[int, int, int]:
    for span in spans:
        if span[0] <= rows.start and rows.stop <= span[1]:
            return span
    raise AssertionError(f"rows {rows} are in no planned window {spans}")  # the plan and the calls disagree


class _Windows:
    """Where parts covering windows of rows (dim 2) land in a ``base`` tensor that covers every row:
    the base's own rows where one window alone covers them (one in-place op there, computed in
    float32 and rounded once), else the rows of a float32 (float64) copy of the span the overlapping
    windows cover, rounded once into the base by :meth:`flush`. Rows no window covers are never
    touched: a neighbour's chunk that one packed document crosses into costs that document's rows,
    not N / P of them. ``windows``: the rows of every part that will come (from the prepared mask)."""

    def __init__(self, base: torch.Tensor, windows: list[tuple[int, int]], acc: torch.dtype):
        self.base, self.acc, self.spans = base, acc, _spans(windows)
        self.copies: dict[int, torch.Tensor] = {}  # span start -> float32 copy of the base's rows there

    def rows(self, rows: slice) -> torch.Tensor:
        """The tensor a part covering ``rows`` is added / merged into (a view)."""
        a, b, parts = _span_of(self.spans, rows)
        if parts == 1:
            return self.base[:, :, rows]
        if a not in self.copies:
            self.copies[a] = self.base[:, :, a:b].to(self.acc)
        return self.copies[a][:, :, rows.start - a:rows.stop - a]

    def flush(self) -> torch.Tensor:
        """The base with the overlapping spans rounded into it (once)."""
        for a, total in self.copies.items():
            self.base[:, :, a:a + total.shape[2]].copy_(total)
        self.copies.clear()
        return self.base


class _Sum:
    """A sum of partial tensors over rows (dim 2: query rows of dQ, key rows of dK / dV).

    With a base part (``windows`` given: the rows of every other part, known from the prepared
    mask), the first part added covers every row and is kept as it came; the others are added over
    their windows only (:class:`_Windows`). Without a base (``windows`` None, or a first part that
    is not whole), a float32 sum over all rows, rounded at the end. A window part (a tensor still
    being sent, say) is never written to; the base is (it is this rank's own chunk's result)."""

    def __init__(self, acc: torch.dtype, windows: list[tuple[int, int]] | None):
        self.acc, self.planned = acc, windows
        self.value = None
        self.windows: _Windows | None = None  # once the base part came

    def add(self, x: torch.Tensor, rows: slice | None = None, like: torch.Tensor | None = None) -> None:
        """Add ``x``: a whole part, or (``rows`` given) the rows ``rows`` of a tensor shaped like ``like``."""
        whole = rows is None or rows == slice(0, like.shape[2])
        if self.value is None and whole and self.planned is not None:
            self.value, self.windows = x, _Windows(x, self.planned, self.acc)
            return
        if self.windows is not None:
            self.windows.rows(slice(0, x.shape[2]) if rows is None else rows).add_(x)
            return
        if self.value is None:
            self.value = torch.zeros(like.shape, dtype=self.acc, device=x.device)
        (self.value if whole else self.value[:, :, rows]).add_(x)

    def result(self, like: torch.Tensor) -> torch.Tensor:
        if self.value is None:
            return torch.zeros_like(like)
        return (self.windows.flush() if self.windows is not None else self.value).to(like.dtype)


def _forward(ring: _Ring, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out [B, Hq, n, Dv], lse [B, Hq, n] float32 / float64)`` over every chunk it sees.

    The own chunk comes first; where it covers every row (``based``), its output is the base and the
    other chunks merge into it over their row windows only (:class:`_Windows`; the lse, float32
    already, in place). Otherwise a running output over all rows (float32 with more than two chunks),
    rounded at the end."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Two chunks merge in float32 and round once into q's dtype; more keep a float32 running output.
    running = acc if len(ring.sources()) > 2 else q.dtype
    n = q.shape[2]
    based = ring.needed[ring.rank][ring.rank] and ring.prepared.window(ring.rank) == (0, n)
    out = lse = windows = None
    for _, src, chunk in ring.kv_chunks(k, v):
        if chunk is None:
            continue
        rows, args = ring.launch_args(src)
        o, l = ring.backend.forward(q[:, :, rows], chunk[0], chunk[1], scale=ring.scale, **args)
        if out is None and rows == slice(0, n):  # the first chunk's result as it is
            out, lse = o, l.to(acc)
            if based:  # the own chunk (step 0)
                windows = _Windows(out, [ring.prepared.window(s) for s in ring.sources() if s != ring.rank], acc)
            continue
        if windows is not None:
            part = windows.rows(rows)
            merge_into(part, lse[:, :, rows], part, lse[:, :, rows], o, l)
            continue
        if out is None:  # the first chunk seen covers some rows only
            out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=running, device=q.device)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        elif out.dtype != running:
            out = out.to(running)
        merge_into(out[:, :, rows], lse[:, :, rows], out[:, :, rows], lse[:, :, rows], o, l)
    if out is None:  # this rank's queries see no key at all
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    if windows is not None:
        windows.flush()
    out = out.to(q.dtype)
    return out, lse


def _backward(ring: _Ring, q, k, v, out, lse, dout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of this rank's tensors: its queries' over every chunk they saw, its keys' summed
    over every rank that used them (returned through the ring)."""
    me = ring.rank
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse if lse.dtype == torch.float64 else lse.float()
    p, n = ring.prepared, q.shape[2]
    # The own chunk's gradients are the base where they cover every row / key (the usual case); the
    # other parts' windows are known from the prepared mask.
    own = ring.needed[me][me]
    rows_of = [p.window(s) for s in ring.sources() if s != me]
    keys_of = [p.sent_window(d) for d in ring.users() if d != me]
    dq = _Sum(acc, rows_of if own and p.window(me) == (0, n) else None)
    keys_based = own and p.key_window(me) == (0, k.shape[2])
    dk, dv = _Sum(acc, keys_of if keys_based else None), _Sum(acc, keys_of if keys_based else None)
    grads_in_flight = []  # (requests, received dK, received dV)
    for step, src, chunk in ring.kv_chunks(k, v):
        dst = ring.comm.send_to(step)
        part = None
        if chunk is not None:
            rows, args = ring.launch_args(src)
            dq_s, dk_s, dv_s = ring.backend.backward(q[:, :, rows], chunk[0], chunk[1], out[:, :, rows],
                                                     lse[:, :, rows], dout[:, :, rows], scale=ring.scale, **args)
            dq.add(dq_s, rows, q)
            part = (dk_s.contiguous(), dv_s.contiguous())
        if step == 0:
            if part is not None:
                mine = slice(*ring.prepared.key_window(me))
                dk.add(part[0], mine, k)
                dv.add(part[1], mine, v)
            continue
        # Return the chunk's gradients to its owner; collect mine from the ranks that used my keys
        # (each the window of my keys it saw).
        sends = [(part[0], src), (part[1], src)] if part is not None else []
        window = ring.prepared.sent_window(dst)
        bufs = _buffers(k, v, window) if ring.needed[dst][me] else None
        recvs = [(bufs[0], dst), (bufs[1], dst)] if bufs else []
        ring._count(sends, skipped=0 if sends else 1)
        grads_in_flight.append((ring.comm.exchange(sends, recvs), bufs, slice(*window), part))
    for reqs, bufs, window, _ in grads_in_flight:
        ring.comm.wait(reqs)
        if bufs is not None:
            dk.add(bufs[0], window, k)
            dv.add(bufs[1], window, v)
    return dq.result(q), dk.result(k), dv.result(v)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = ring.run("forward", _forward, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.ring.run("backward", _backward, q, k, v, out, lse, dout.contiguous())
        return dq, dk, dv, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: FlashMask | PreparedMask,
    plan: ShardPlan | None = None,
    group=None,
    *,
    scale: float | None = None,
    impl: str | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """FlashMask attention over a context-parallel group, ring schedule with exact transfer skipping.

    Args:
        q: ``[B, Hq, N / P, D]``, this rank's queries in the order of ``plan.positions[rank]``;
            k, v: ``[B, Hkv, N / P, D | Dv]`` likewise.
        mask: the step's :class:`PreparedMask` (:func:`fm_parallel.distributed.prepare`, once per
            step: the agreement, pair table, column masks and launch plans are then made once for
            every layer), or the full FlashMask (``N`` key columns, global rows; prepared per call).
        plan: from :func:`fm_parallel.distributed.shard`, the same on every rank (optional with a
            prepared mask).
        group: the context-parallel process group (default: the world).
        impl: the local kernel, resolved like ``flashmask_attention``'s (:mod:`fm_parallel.backends`):
            ``"auto"`` / None, ``"cute"``, ``"triton"`` or ``"torch"``; others raise.
        stats: filled with this rank's transfers posted and skipped, bytes sent and visible pairs.
    Returns:
        ``[B, Hq, N / P, Dv]``: this rank's rows of the attention output. Differentiable.
    Raises:
        ValueError: bad shapes, an unknown or unavailable impl, an in-place edit of a prepared mask,
            another plan than the prepared one, or ranks that disagree on shapes, dtype, impl, scale,
            gradients, plan or mask, at any layer (raised on every rank).
    """
    prepared, _, _, name = for_call(q, k, v, mask, plan, group, impl=impl, chunked=True, scale=scale)
    return ring_agreed(q, k, v, prepared, group, scale, name, stats)


def ring_agreed(q, k, v, prepared: PreparedMask, group, scale, name: str, stats: RingStats | None = None):
    """The ring on an agreed prepared mask, with the kernel the agreement resolved (hybrid calls it
    after its own agreement)."""
    d = q.shape[-1]
    if stats is not None:
        stats.visible_pairs += int(prepared.table[prepared.rank].sum())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    backend = backends.get(name)
    ring = _Ring(prepared, prepared.comm(group), scale, backend, stats)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring)


def ring_attention_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prepared: PreparedMask, comm, backend, *,
                        scale: float | None = None, stats: RingStats | None = None) -> torch.Tensor:
    """One rank's ring over a transport and a backend the caller brings: no agreement, no resolution.

    For running the ranks of a ring in one process: a benchmark's stand-in for P GPUs on one
    (``launch/bench/cp_layer_cost.py``: device copies for transfers, launchers timed per step).

    Args:
        q, k, v: this rank's shards, as for :func:`ring_attention`.
        prepared: this rank's :class:`PreparedMask` (``PreparedMask(mask, plan, rank, device)``).
        comm: the transport, with :class:`~fm_parallel.distributed.comm.RingComm`'s interface
            (``rank``, ``world_size``, ``send_to(step)``, ``recv_from(step)``, ``exchange(sends, recvs)``,
            ``wait(pending)``; ``capturable = True`` if CUDA graphs may capture it).
        backend: the local kernel's launchers, ``fm_parallel.backends.get(name)`` or an object with the
            same ``forward`` / ``backward``.
        stats: filled with this rank's transfers posted and skipped and bytes sent.
    Returns:
        ``[B, Hq, N / P, Dv]``, differentiable (the ring's own backward).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ring = _Ring(prepared, comm, scale, backend, stats)
    return _RingAttention.apply(q, k, v, ring)
