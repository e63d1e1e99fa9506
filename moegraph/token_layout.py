"""The token layout: which tokens of a [b, s, h] batch each rank holds between the layer's blocks.

Notation (MegaScale-MoE Table 1):
    b: micro-batch   s: sequence   h: hidden   n: group size (the ranks one layer spans)
    N: nodes the attention is data-parallel over (Strategy.attn_nodes)
    G: ranks one attention spans, n/N (the ranks of a node)

Rank r = q*G + l (node q, local index l) holds batch rows [q b/N, (q+1) b/N) and sequence shard
l of G:
    x[q b/N : (q+1) b/N, l s/G : (l+1) s/G, :]    [b/N, s/G, h]
With N = 1 that is [b, s/n, h], MegaScale-MoE's sequence-parallel layout. With N > 1 the attention
runs TP or SP over the G ranks of a node on the node's b/N rows, and the experts stay EP over all
n ranks: the MoE block is token-wise, so the T = b s / n tokens a rank sends to the experts are
the same count either way (Megatron-Core's "MoE parallel folding").
"""

from __future__ import annotations

from typing import Sequence

import torch

from moegraph.strategy import Strategy


def local_tokens(b: int, s: int, strategy: Strategy) -> tuple[int, int]:
    """(rows, sequence) one rank holds: (b/N, s/G)."""
    return b // strategy.attn_nodes, s // strategy.attn_ranks


def seq_shard(strategy: Strategy, rank: int) -> tuple[int, int]:
    """(l, G): rank's sequence shard and how many there are (what RoPE positions and masks read)."""
    G = strategy.attn_ranks
    return rank % G, G


def batch_rows(strategy: Strategy, rank: int, b: int) -> slice:
    """The batch rows rank holds, of b: [q b/N, (q+1) b/N)."""
    rows = b // strategy.attn_nodes
    q = rank // strategy.attn_ranks
    return slice(q * rows, (q + 1) * rows)


def check_tokens(b: int, s: int, strategy: Strategy) -> None:
    """ValueError naming the size the layout cannot split."""
    N, G = strategy.attn_nodes, strategy.attn_ranks
    if b % N:
        raise ValueError(f"batch has {b} rows, not divisible by attn_nodes={N} (each node's attention takes b/N rows)")
    if s % G:
        raise ValueError(f"sequence length {s} is not divisible by n/attn_nodes={G}"
                         if N > 1 else f"sequence length {s} is not divisible by n={G}")


def shard_tokens(x: torch.Tensor, strategy: Strategy, rank: int) -> torch.Tensor:
    """[b, s, ...] -> rank's [b/N, s/G, ...] (a view: callers copy where they need to)."""
    check_tokens(x.shape[0], x.shape[1], strategy)
    l, G = seq_shard(strategy, rank)
    return x[batch_rows(strategy, rank, x.shape[0])].chunk(G, dim=1)[l]


def unshard_tokens(parts: Sequence[torch.Tensor], strategy: Strategy) -> torch.Tensor:
    """Every rank's [b/N, s/G, ...], in rank order -> [b, s, ...]."""
    G = strategy.attn_ranks
    if len(parts) != strategy.n:
        raise ValueError(f"unshard_tokens: {len(parts)} parts for n={strategy.n} ranks")
    return torch.cat([torch.cat(list(parts[q * G:(q + 1) * G]), dim=1) for q in range(strategy.attn_nodes)], dim=0)


def gathered_tokens(x: torch.Tensor, strategy: Strategy) -> torch.Tensor:
    """[b, s, ...] in the order an all-gather of every rank's tokens along the sequence leaves them:
    [b/N, N s, ...] (rank 0's [b/N, s/G], rank 1's, ...); x itself when N = 1."""
    if strategy.attn_nodes == 1:
        return x
    return torch.cat([shard_tokens(x, strategy, r) for r in range(strategy.n)], dim=1)
