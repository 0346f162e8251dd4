"""Context parallelism: sharding plans, ring, Ulysses and hybrid schedules, the merge, the process grid."""

from fm_parallel.distributed.dims import ParallelDims
from fm_parallel.distributed.hybrid import hybrid_attention
from fm_parallel.distributed.merge import merge
from fm_parallel.distributed.prepared import PreparedMask, prepare
from fm_parallel.distributed.ring import RingStats, ring_attention
from fm_parallel.distributed.sharding import BALANCE_MODES, ShardPlan, pair_counts, pair_table_and_key_windows, row_work, shard
from fm_parallel.distributed.ulysses import heads_to_seq, seq_to_heads, ulysses_attention
from fm_parallel.distributed.context import ContextParallel  # noqa: E402 - after the schedules it uses

__all__ = ["ParallelDims", "ShardPlan", "shard", "prepare", "PreparedMask", "pair_counts", "pair_table_and_key_windows", "row_work", "BALANCE_MODES", "merge",
           "ring_attention", "RingStats", "ulysses_attention", "seq_to_heads", "heads_to_seq", "hybrid_attention",
           "ContextParallel"]
