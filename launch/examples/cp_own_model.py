"""Context parallelism for a model of your own: FlashMask attention under ring or Ulysses CP.

A tiny causal language model (embeddings, two attention + MLP blocks, a head) trains a few steps on
one packed row of three documents. Its attention is one function: ``flashmask_attention`` on one
process, ``ContextParallel.attention`` under torchrun, where each rank holds ``N / P`` tokens of the
row (``plan.shard``) and their global positions (``plan.position_ids``). The losses printed are the
whole row's, and equal one process's::

    python launch/examples/cp_own_model.py                                            # one process
    torchrun --standalone --nproc_per_node 2 launch/examples/cp_own_model.py --cp ring
    torchrun --standalone --nproc_per_node 2 launch/examples/cp_own_model.py --cp ulysses

On CPUs the ranks talk over gloo; with GPUs (one per rank) over NCCL.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fm_parallel import flashmask_attention, masks
from fm_parallel.distributed import ContextParallel, shard

DOCS = [20, 28, 16]  # one packed row of three documents, N = 64 tokens
VOCAB, DIM, HEADS = 97, 32, 4


class TinyLM(nn.Module):
    """Your own model: ``attend(q, k, v)`` ([B, H, n, D] each, n the tokens this process holds) is
    the only place attention happens, so CP changes one argument, not the model."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, max_len: int = 64, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(norm1=nn.LayerNorm(dim), qkv=nn.Linear(dim, 3 * dim), out=nn.Linear(dim, dim),
                                                       norm2=nn.LayerNorm(dim), mlp=nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))))
                                    for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """``ids``, ``positions``: ``[B, n]`` (global positions of the tokens held); logits ``[B, n, vocab]``."""
        x = self.embed(ids) + self.pos(positions)
        b, n, dim = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            x = x + blk["out"](attend(q, k, v).transpose(1, 2).reshape(b, n, dim))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(self.norm(x))


def data(seed: int = 0):
    """The row: token ids ``[1, N]``, labels shifted per document on the whole row *before* sharding
    (a shard's last token's label is the next shard's first token; -100 at each document's end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=g)
    labels = torch.full_like(ids, -100)
    start = 0
    for n in DOCS:
        labels[:, start:start + n - 1] = ids[:, start + 1:start + n]
        start += n
    return ids, labels


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", choices=["ring", "ulysses"], default="ring", help="the CP schedule under torchrun")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, labels = data()
    mask = masks.document(DOCS)  # built where the data is: O(N) bounds, the same on every rank
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        plan = shard(mask, world, balance="contiguous")  # which tokens each rank holds
        ctx = ContextParallel(args.cp, plan)  # or "hybrid" with mesh=
        ids_l, labels_l = plan.shard(ids, rank, dim=-1), plan.shard(labels, rank, dim=-1)
        pos_l = plan.position_ids(rank)[None]
        attend = lambda q, k, v: ctx.attention(q, k, v, mask)  # noqa: E731 - prepared once, reused by every layer
    else:
        rank, ids_l, labels_l, pos_l = 0, ids, labels, torch.arange(ids.shape[1])[None]
        attend = lambda q, k, v: flashmask_attention(q, k, v, mask=mask)  # noqa: E731
    ids_l, labels_l, pos_l = ids_l.to(device), labels_l.to(device), pos_l.to(device)
    total = int((labels != -100).sum())  # the whole row's label count, known on every rank

    losses = []
    for step in range(args.steps):
        logits = model(ids_l, pos_l, attend)
        # This rank's share of the row's mean loss; the shares sum to it (and their gradients to its).
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels_l.flatten(), ignore_index=-100, reduction="sum") / total
        opt.zero_grad()
        loss.backward()
        if world > 1:  # the parameters are replicated: sum the ranks' gradients and losses
            for p in model.parameters():
                dist.all_reduce(p.grad)
            loss = loss.detach()
            dist.all_reduce(loss)
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
