"""fm_parallel: FlashMask attention with context parallelism for long-context training.

    from fm_parallel import FlashMask, flashmask_attention, masks
    mask = masks.document([1000, 3000, 4192])             # packed documents, causal
    out = flashmask_attention(q, k, v, mask=mask)         # q, k, v: [B, H, N, D]
"""

from fm_parallel import masks
from fm_parallel.attention import flashmask_attention
from fm_parallel.masks import FlashMask, MaskNotExpressible

__all__ = ["FlashMask", "MaskNotExpressible", "flashmask_attention", "masks"]
__version__ = "0.1.0"
