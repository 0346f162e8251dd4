"""A step's mask as one context-parallel rank uses it: prepared once, reused by every layer.

A training step runs attention once per layer, forward and backward, all under the same mask and
plan. Everything derived from them is made here once per step, where the row is sharded (after the
data loader), and every layer reuses it:

* the digests the agreement compares (BLAKE2b of the bounds and positions, cached). The agreement
  itself runs on every call (one small all-gather of a few integers: shapes, dtype, device type,
  kernel, scale, whether a backward follows, the two digests), so a rank that alone changes any of
  them at a later layer fails with its peers, never leaves them waiting;
* the ring's exact pair table and what each rank needs from each other rank: whether, and which
  window of the other rank's keys (the first to the last key any of its queries sees). Only that
  window travels, is computed on and has gradients returned: a neighbour's chunk that one packed
  document crosses into costs that document's keys, not ``N / P`` of them;
* per source rank, the column mask of that rank's key window *in this rank's local rows*: the rank's
  queries are ``plan.positions[rank]`` (sorted), so an interval of global rows ``[s, e]`` is the
  contiguous range of local rows between two binary searches. The kernels then always see
  consecutive rows from 0 (whatever the balance mode: the cheaper consecutive-row launch plans, no
  per-score row lookup in FA4's mask_mod), and the diagonal chunk of a packed-causal-document or
  causal mask *is* packed causal documents in local rows (the tokens of a document that this rank
  holds are adjacent in its order), which ``impl="cute"`` runs on FA4's varlen / causal kernels;
* the launch plans / FA4 block lists of every (source chunk, this rank's rows): built by the first
  layer that needs them and cached on those column masks, so layers 2..L, and the backward, find them;
* Ulysses' sequence order and this rank's head slice of the mask; hybrid's group plan and the inner
  ring's prepared mask.

``ring_attention`` / ``ulysses_attention`` / ``hybrid_attention`` take a PreparedMask wherever they
take a FlashMask; given a bare FlashMask they prepare one per call (correct, and what a one-off
call wants, but the plan builds per call).
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from fm_parallel.distributed.comm import RingComm, check_agreement, check_cp_inputs
from fm_parallel.distributed.graphs import LayerGraphs
from fm_parallel.distributed.sharding import ShardPlan, pair_table_and_key_windows
from fm_parallel.masks.flashmask import FlashMask

__all__ = ["PreparedMask", "prepare", "for_call", "local_prepare", "fail_together", "local_rows", "check_grid_mesh", "prepare_agreed"]


class PreparedMask:
    """What one rank derives from ``(mask, plan)`` for a step. Build with :func:`prepare`.

    Attributes:
        mask: the full mask on the rank's device. plan: the :class:`ShardPlan`.
        rank: this rank's index in ``plan.positions``. world: ``plan.world_size``.
        table: ``[P, P]`` int64 visible pairs (rank r's queries, rank j's keys), on the CPU.
        needed: ``needed[r][j]``, rank r's queries see rank j's keys.
        spans: ``spans[r][j] = (c0, c1)``, the local indices of rank j's keys that rank r's queries
            see lie in ``[c0, c1)`` (``(0, 0)`` where none): :meth:`key_window`, :meth:`sent_window`.
        rows: this rank's global query rows, ``[N / P]`` int32 on the device.
        local_rows: ``arange(N / P)`` int32 on the device, the rows the column masks are written in.
        counters: how often derived data was built (``columns``), a new call signature was agreed
            (``agreements``) and a call was checked across ranks (``checks``: every call), for tests
            and benchmarks.
        graphs: the step's :class:`~fm_parallel.distributed.graphs.LayerGraphs` (the ring's layers
            captured once and replayed) when prepared with ``cuda_graphs=True``, else None.
    """

    def __init__(self, mask: FlashMask, plan: ShardPlan, rank: int, device: torch.device,
                 host_mask: FlashMask | None = None, cuda_graphs: bool = False):
        _check_mask_and_plan(mask, plan)
        try:  # ints of any kind (numpy's too), not bools or floats
            index = None if isinstance(rank, bool) else operator.index(rank)
        except TypeError:
            index = None
        if index is None or not 0 <= index < plan.world_size:
            raise ValueError(f"rank: expected an int in [0, {plan.world_size}) (the plan's ranks), got {rank!r}")
        rank = index
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
        if cuda_graphs and torch.device(device).type != "cuda":
            raise ValueError(f"cuda_graphs: expected q / k / v on a CUDA device for CUDA graphs, got device {device}")
        self.graphs = LayerGraphs() if cuda_graphs else None
        self.mask, self.plan, self.rank, self.device = mask, plan, rank, device
        # The mask where the loader built it (the CPU), if it was there: the diagonal chunk learns its
        # document structure from it without a device sync.
        self.host_mask = host_mask if host_mask is not None and host_mask.device.type == "cpu" else None
        self.world = plan.world_size
        self.table, spans = pair_table_and_key_windows(mask, plan.positions)
        self.needed = (self.table > 0).tolist()
        self.spans = [[tuple(w) for w in row] for row in spans.tolist()]
        self.rows = plan.positions[rank].to(device=device, dtype=torch.int32)
        self.local_rows = torch.arange(plan.local_tokens, device=device, dtype=torch.int32)
        self.counters = {"columns": 0, "agreements": 0, "checks": 0}
        self._versions = self._bounds_versions()
        self._columns: dict[int, FlashMask] = {}
        self._agreed: dict[tuple, tuple[int, int]] = {}
        self._derived: dict = {}
        self._comm: RingComm | None = None

    def __repr__(self) -> str:
        return (f"PreparedMask(rank={self.rank}/{self.world}, N={self.plan.num_tokens}, balance={self.plan.balance!r}, "
                f"mask={self.mask!r})")

    # ------------------------------------------------------------------ ring
    def key_window(self, source: int) -> tuple[int, int]:
        """``(c0, c1)``: the keys of rank ``source`` (its local indices) that this rank's queries see
        lie in ``[c0, c1)``; the ring receives, computes on and returns gradients for that slice only."""
        return self.spans[self.rank][source]

    def sent_window(self, dest: int) -> tuple[int, int]:
        """``(c0, c1)``: the slice of this rank's keys that rank ``dest`` receives (its :meth:`key_window`)."""
        return self.spans[dest][self.rank]

    def columns(self, source: int) -> FlashMask:
        """The mask's columns of rank ``source``'s key window (:meth:`key_window`) in this rank's local
        rows (``[0, N / P)``), made once."""
        if source not in self._columns:
            self._make_columns(source)
        return self._columns[source][0]

    def window(self, source: int) -> tuple[int, int]:
        """``(r0, r1)``: the local rows that see at least one of rank ``source``'s keys are inside
        ``[r0, r1)``. The ring runs that chunk on those rows only: a neighbour's chunk that one packed
        document crosses into costs that document's rows, not ``N / P`` of them (kernels and FA4's
        per-call passes over every query row alike)."""
        if source not in self._columns:
            self._make_columns(source)
        return self._columns[source][1]

    def _make_columns(self, source: int) -> None:
        c0, c1 = self.key_window(source)
        # A source this rank does not need keeps all its (here empty) columns: asked for anyway, its
        # window is (0, 0) and its column mask a valid one.
        keys = self.plan.positions[source][c0:c1] if c1 > c0 else self.plan.positions[source]
        if self.host_mask is not None:
            # On the host, where the loader built the mask: no device synchronisation, and the diagonal
            # chunk learns whether it is packed causal documents. Copied with non_blocking from pageable
            # memory: CUDA stages the bytes before returning and does not wait for the device (pinning
            # each small tensor costs a page-locked allocation per source and step).
            cols = local_rows(self.host_mask.select_keys(keys), self.plan.positions[self.rank])
            window = _row_window(cols)
            if self.device.type == "cuda":
                documents = cols.causal_documents()
                cols = FlashMask(cols.fms.to(self.device, non_blocking=True),
                                 cols.fme.to(self.device, non_blocking=True), cols.num_rows, validate=False)
                cols.set_causal_documents(documents)
            else:
                cols = cols.to(self.device)
        else:  # a mask made on the device: one small synchronisation per source and step, for the window
            cols = local_rows(self.mask.select_keys(keys.to(self.device)), self.rows)
            window = _row_window(cols)
        self._columns[source] = (cols, window)
        self.counters["columns"] += 1

    def comm(self, group) -> RingComm:
        if self._comm is None or self._comm.group is not group:
            self._comm = RingComm(group)
        return self._comm

    def derived(self, key, make):
        """``make()`` once per prepared mask and ``key`` (Ulysses' order, head slices, hybrid plans)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    # ------------------------------------------------------------- agreement
    def agree(self, q, k, v, group, *, plan=None, groups: list | None = None, impl: str | None = "auto",
              chunked: bool = False, scale: float | None = None) -> tuple[int, int, str]:
        """All ranks agree on this call: its shapes, dtype, device type, kernel (``impl`` resolved here,
        ``chunked`` for the ring), scale, whether a backward follows, the mask and the plan. Every call
        (every layer), in one small all-gather of a few integers, so that a rank that alone changes
        any of them at a later layer fails with its peers instead of leaving them in a collective it
        never joins. Returns ``(world, rank, backend name)``.

        Checked here first, on this rank alone, and raised on every rank through the agreement: an
        in-place edit of the mask since it was prepared, a ``plan`` that is not the one the mask was
        prepared with, a group in which this rank is another rank than the mask was prepared for."""
        problem = None
        if self._bounds_versions() != self._versions:
            # Everything derived (pair table, column masks, windows, plans) describes the old bounds:
            # running on would be silently wrong.
            problem = ("mask: changed in place after it was prepared (its bounds' version moved); "
                       "call prepare() again after editing a mask")
        elif plan is not None and plan is not self.plan and (not isinstance(plan, ShardPlan) or plan.digest() != self.plan.digest()):
            problem = "plan: expected the plan the mask was prepared with (or None), got a different plan"
        elif groups is None and dist.is_initialized() and dist.get_rank(group) != self.rank:
            problem = (f"group: expected the group the mask was prepared for (rank {self.rank} there), got rank "
                       f"{dist.get_rank(group)} in this group")
        world = self.world if groups is not None else None
        result = check_cp_inputs(q, k, v, self.mask, self.plan, group, groups=groups, world=world, problem=problem,
                                 impl=impl, chunked=chunked, scale=scale)
        key = _agreement_key(q, k, v, group, groups)
        if key not in self._agreed:  # a new shape signature this step
            self._agreed[key] = result[:2]
            self.counters["agreements"] += 1
        self.counters["checks"] += 1
        return result

    def made_from(self, mask) -> bool:
        """Whether ``mask`` is the FlashMask this was prepared from, or its device copy, with its bounds
        unedited since: then this prepared mask still describes it, and a caller that passes the same
        FlashMask to every layer (:class:`~fm_parallel.distributed.context.ContextParallel`) reuses it.
        Object identity, never ``id()``: this prepared mask holds both masks, so neither can be freed
        and another take its place."""
        for i, held in enumerate(self._masks()):
            if held is mask:
                return (mask.fms._version, mask.fme._version) == self._versions[2 * i : 2 * i + 2]
        return False

    def _masks(self) -> tuple[FlashMask, ...]:
        return (self.mask,) if self.host_mask is None else (self.mask, self.host_mask)

    def _bounds_versions(self) -> tuple[int, ...]:
        return tuple(t._version for m in self._masks() for t in (m.fms, m.fme))


def _agreement_key(q, k, v, group, groups) -> tuple:
    """What an agreement holds for: the call's shapes, dtypes and device types, and its groups."""
    signature = tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else type(t)
                      for t in (q, k, v))
    return signature, id(group), tuple(id(g) for g in groups) if groups else None


def _mesh_groups(mesh) -> list | None:
    """The groups a hybrid grid agrees over, Ulysses then ring (None without a mesh)."""
    return [mesh.get_group("ulysses"), mesh.get_group("ring")] if mesh is not None else None


def prepare(mask: FlashMask, plan: ShardPlan, group=None, *, mesh=None, device=None,
            cuda_graphs: bool = False) -> PreparedMask:
    """Prepare ``mask`` under ``plan`` for this rank, once per step; pass the result to the attention
    of every layer in place of the mask. Collective: every rank of the group (grid) calls it, and a
    rank whose mask or plan is bad, or differs from its peers', makes every rank raise the same error.

    Args:
        mask: the full FlashMask (``N`` key columns, global rows), the same on every rank.
        plan: from :func:`fm_parallel.distributed.shard`, the same on every rank.
        group: the context-parallel group (ring, Ulysses; default: the world).
        mesh: the 2-D ``("ring", "ulysses")`` DeviceMesh instead (hybrid).
        device: where the layers' q / k / v live (default: the mask's device); the mask is moved there.
        cuda_graphs: the ring's forward and backward captured as CUDA graphs by the second layer of
            the step and replayed by every later one (:mod:`fm_parallel.distributed.graphs`: host
            time per layer of a replay instead of the launchers', for about 1 ms of extra copies per
            layer at 32k local tokens). Ring mode, CUDA tensors and an NCCL group only.
    Raises:
        ValueError: a bad or disagreeing mask or plan (named), no initialised process group, or
            ``cuda_graphs`` where graphs cannot run (a mesh, a non-CUDA device, a gloo group).
    """
    return _prepare(mask, plan, group, mesh=mesh, device=device, check=True, cuda_graphs=cuda_graphs)


def _check_mask_and_plan(mask, plan) -> None:
    """A FlashMask and a ShardPlan of the same N, square (queries and keys follow the one plan)."""
    for name, value, kind in (("mask", mask, FlashMask), ("plan", plan, ShardPlan)):
        if not isinstance(value, kind):
            raise ValueError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
    _check_sizes(mask, plan)


def _check_sizes(mask: FlashMask, plan: ShardPlan) -> None:
    if mask.num_keys != plan.num_tokens:
        raise ValueError(f"mask: expected a FlashMask with {plan.num_tokens} key columns (the plan's N), got {mask.num_keys}")
    if mask.num_rows != plan.num_tokens:  # queries and keys are sharded by the one plan
        raise ValueError(f"mask: expected a self-attention mask of {plan.num_tokens} rows (the plan's N), got {mask.num_rows}")


def check_grid_mesh(mesh) -> None:
    """Raise ``ValueError`` unless ``mesh`` is the hybrid's 2-D DeviceMesh with dims ``("ring", "ulysses")``."""
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or tuple(names) != ("ring", "ulysses"):
        raise ValueError(f"mesh: expected a 2-D DeviceMesh with dims ('ring', 'ulysses'), got dims {names}")


def prepare_agreed(mask: FlashMask, plan: ShardPlan, group=None, *, device=None) -> PreparedMask:
    """:func:`prepare` without its agreement collective, for a caller whose own agreement already
    covered this mask and plan on every rank (the hybrid's inner ring: its mask and plan are derived
    from the agreed grid's)."""
    return _prepare(mask, plan, group, device=device, check=False)


def _prepare(mask, plan, group=None, *, mesh=None, device=None, check: bool, cuda_graphs: bool = False) -> PreparedMask:
    if not dist.is_initialized():
        _check_mask_and_plan(mask, plan)
        raise ValueError("group: expected an initialised torch.distributed process group, got none")

    if mesh is not None:
        check_grid_mesh(mesh)
    groups = _mesh_groups(mesh)
    world = mesh.size() if mesh is not None else dist.get_world_size(group)
    rank = _plan_rank(group, mesh)
    problem = None
    if not isinstance(mask, FlashMask):
        problem = f"mask: expected a FlashMask, got {type(mask).__name__}"
    elif not isinstance(plan, ShardPlan) or plan.world_size != world:
        got = plan.world_size if isinstance(plan, ShardPlan) else type(plan).__name__
        problem = f"plan: expected a ShardPlan for the group's {world} ranks, got {got}"
    else:
        try:
            _check_sizes(mask, plan)
        except ValueError as e:
            problem = str(e)
    device = (mask.device if device is None else torch.device(device)) if isinstance(mask, FlashMask) else None
    problem = problem or _graphs_problem(cuda_graphs, mesh, group, device)
    if check:  # every rank joins, so a rank's problem (or a disagreement) raises on all of them
        values = [0, 0, 0] if problem else [mask.digest(), plan.digest(), int(cuda_graphs)]
        check_agreement(values, ["mask", "plan", "cuda_graphs"], group, problem=problem, groups=groups)
    elif problem:
        raise ValueError(problem)
    return PreparedMask(mask.to(device), plan, rank, device, host_mask=mask, cuda_graphs=cuda_graphs)


def _graphs_problem(cuda_graphs, mesh, group, device) -> str | None:
    """Why ``cuda_graphs`` cannot run here (a message), or None."""
    if not isinstance(cuda_graphs, bool):
        return f"cuda_graphs: expected a bool, got {cuda_graphs!r}"
    if not cuda_graphs:
        return None
    if mesh is not None:
        return "cuda_graphs: expected the ring (a group, no mesh), got a hybrid mesh; prepare without cuda_graphs"
    if device is None or device.type != "cuda":
        return f"cuda_graphs: expected q / k / v on a CUDA device for CUDA graphs, got device {device}"
    if dist.get_backend(group) != "nccl":
        return (f"cuda_graphs: expected an NCCL group (its transfers can be captured), got "
                f"{dist.get_backend(group)!r}; prepare without cuda_graphs")
    return None


def local_rows(columns: FlashMask, rows: torch.Tensor) -> FlashMask:
    """``columns`` (global rows) rewritten in the local rows of a rank holding the sorted global
    ``rows``: local row ``i`` is global row ``rows[i]``, so the global interval ``[s, e]`` holds the
    local rows from the first ``rows[i] >= s`` to the last ``rows[i] <= e``. Intervals stay sorted
    and disjoint; empty ones become the canonical ``(len(rows), -1)``."""
    rows = rows.to(device=columns.device, dtype=torch.int64)
    n = rows.numel()
    start = torch.searchsorted(rows, columns.fms.to(torch.int64), right=False)
    end = torch.searchsorted(rows, columns.fme.to(torch.int64), right=True) - 1
    empty = (start > end) | (columns.fms > columns.fme)
    fms = torch.where(empty, torch.full_like(start, n), start).to(torch.int32)
    fme = torch.where(empty, torch.full_like(end, -1), end).to(torch.int32)
    return FlashMask(fms, fme, n, validate=False)


def _row_window(columns: FlashMask) -> tuple[int, int]:
    """``(first, last + 1)`` of the rows any interval of ``columns`` holds; ``(0, 0)`` for none."""
    nonempty = columns.fms <= columns.fme
    if not bool(nonempty.any()):
        return 0, 0
    return int(columns.fms[nonempty].min()), int(columns.fme[nonempty].max()) + 1


def _plan_rank(group, mesh) -> int:
    if mesh is not None:
        return mesh.get_local_rank("ring") * mesh["ulysses"].size() + mesh.get_local_rank("ulysses")
    return dist.get_rank(group)


def local_prepare(q, mask, plan, group=None, *, mesh=None, cuda_graphs: bool = False
                  ) -> tuple[PreparedMask | None, str | None]:
    """``(prepared, None)``, or ``(None, why)`` when ``mask`` / ``plan`` cannot be prepared here: on this
    rank alone, no collective. The call that uses it agrees (:meth:`PreparedMask.agree` checks the mask
    and plan digests on every call), and a ``why`` must reach every rank through :func:`fail_together`."""
    device = q.device if isinstance(q, torch.Tensor) else None
    try:
        return _prepare(mask, plan, group, mesh=mesh, device=device, check=False, cuda_graphs=cuda_graphs), None
    except ValueError as e:
        if not dist.is_initialized():
            raise
        return None, str(e)


def fail_together(q, k, v, mask, plan, group=None, *, mesh=None, problem: str) -> None:
    """Join this call's agreement with ``problem``: every rank raises the same ValueError (the peers
    are in the same all-gather through their own :meth:`PreparedMask.agree`)."""
    groups = _mesh_groups(mesh)
    check_cp_inputs(q, k, v, mask, plan, None if mesh is not None else group, groups=groups,
                    world=mesh.size() if mesh is not None else None, problem=problem)
    raise AssertionError("unreachable: the agreement raises the problem")


def for_call(q, k, v, mask, plan, group=None, *, mesh=None, impl: str | None = "auto", chunked: bool = False,
             scale: float | None = None) -> tuple[PreparedMask, int, int, str]:
    """The prepared mask of one attention call, ``(world, rank)`` and the resolved kernel name, after
    this call's agreement (every call: :meth:`PreparedMask.agree`). ``mask`` itself when prepared,
    else one prepared here for this call (on this rank alone; the agreement then checks it against
    the peers' before anything else runs). Exactly one agreement per call on every path, so ranks
    whose paths differ (one re-prepares an edited mask, the others reuse theirs) still meet."""
    groups = _mesh_groups(mesh)
    agree_group = None if mesh is not None else group
    prepared = mask
    if not isinstance(mask, PreparedMask):
        prepared, problem = local_prepare(q, mask, plan, group, mesh=mesh)
        if problem is not None:
            fail_together(q, k, v, mask, plan, group, mesh=mesh, problem=problem)
    world, rank, name = prepared.agree(q, k, v, agree_group, plan=plan, groups=groups, impl=impl, chunked=chunked,
                                   scale=scale)
    return prepared, world, rank, name
