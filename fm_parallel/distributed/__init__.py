"""Context parallelism: sharding plans, the ring schedule, the merge, the process-grid description."""

from fm_parallel.distributed.dims import ParallelDims
from fm_parallel.distributed.merge import merge
from fm_parallel.distributed.ring import RingStats, ring_attention
from fm_parallel.distributed.sharding import BALANCE_MODES, ShardPlan, pair_counts, row_work, shard

__all__ = ["ParallelDims", "ShardPlan", "shard", "pair_counts", "row_work", "BALANCE_MODES",
           "merge", "ring_attention", "RingStats"]
