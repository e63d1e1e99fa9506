"""Rank-local kernels for every compute op: ``run_compute`` and the (op, role) -> kernel table.

The reference interpreter (simulated ranks) and the runtime (real ranks) both execute
compute nodes through ``run_compute``; they differ only in how collectives move data.
Backward kernels are written out in closed form where that is short (GEMM, RMSNorm, RoPE,
SwiGLU); attention and the router differentiate their forward kernel with autograd, which is
exact and, unlike ``torch.func.vjp``, adds no functional-transform overhead per call. The
routing index maps live in ``moegraph.index_map``, the grouped GEMM in ``moegraph.grouped_gemm``,
the router's kernels in ``moegraph.router_kernels``.

Notation: b batch, S sequence on this rank after the op's layout, h hidden, T tokens,
k top-k, R expert rows, El experts on this rank, C = T * min(k, El) padded expert rows.

Padded expert rows (``RankContext.expert_rows == "padded"``, layout 'local' only): the index map
has C >= R rows, the first R real, rows R..C-1 padding (other ranks' rows, left in place by the
sort). Padding must contribute exactly nothing: a grouped GEMM's output rows past the last offset
are uncomputed memory (``torch._grouped_mm``) and are zeroed; every kernel that sums rows back into
tokens or routing slots (UNPERMUTE, PERMUTE's backward, UNPERMUTE's weight gradient) masks them
first; grouped weight gradients never read rows past the last offset. Masks are ``masked_fill``
(NaN-safe: garbage times a zero mask would still be NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from moegraph.family_kernels import scale_rows
from moegraph.grouped_gemm import grouped_rows, grouped_weight_grad
from moegraph.index_map import build_index_map
from moegraph.ir import ExpertRows, Node, OpKind, Role, bad_choice, check_expert_rows
from moegraph.models import apply_rope, causal_gqa_attention, rms_norm, rope_cos_sin
from moegraph.router_kernels import aux_stats, pullback, route_tokens, router_pullback, tokens
from moegraph.tokens import Tokens, rope_positions
from moegraph import token_layout


@dataclass(frozen=True)
class RankContext:
    rank: int
    n: int
    seq: int                      # full sequence length s
    expert_rows: ExpertRows = "exact"   # the local index map's rows (build_index_map)
    # tables made from sizes alone, never from data (RoPE's cos/sin, chunked attention's order), made
    # once per rank and reused by every step: rebuilding them cost each node a dozen small kernels
    tables: dict = field(default_factory=dict, compare=False, repr=False)
    # the step's batch layout (padding, packed documents: moegraph.tokens), full [b, s] on every
    # rank; None: b plain causal sequences. A step runs with dataclasses.replace(ctx, tokens=...)
    tokens: Tokens | None = field(default=None, compare=False, repr=False)
    # (l, G): this rank's sequence shard of G (moegraph.token_layout.seq_shard), what positions are read
    # from; None: (rank, n). An attention on a node's ranks (Strategy.attn_nodes) shards over G < n
    shard: tuple[int, int] | None = None

    @property
    def seq_shard(self) -> tuple[int, int]:
        return self.shard or (self.rank, self.n)

    @classmethod
    def of(cls, graph, rank: int, expert_rows: ExpertRows = "exact") -> "RankContext":
        """Rank ``rank``'s context for ``graph``: its sequence shard by the graph's token layout."""
        return cls(rank, graph.strategy.n, graph.dims.s, expert_rows, shard=token_layout.seq_shard(graph.strategy, rank))

    def __post_init__(self):
        check_expert_rows(self.expert_rows)


def run_compute(ctx: RankContext, node: Node, ins: list[Any], out_shapes: list[tuple[int, ...]]) -> list[Any]:
    """Execute one compute node on one rank.

    attr accumulate=True (a weight-gradient kernel adding into a running sum): the last input
    is that sum, and the kernel's single output is added to it.
    """
    fn = KERNELS.get((node.op, node.role))
    if fn is None:
        raise NotImplementedError(f"no kernel for {node.op.value}/{node.role.value} (node {node.name!r})")
    if node.typed.accumulate:
        (out,) = fn(ctx, node, ins[:-1], out_shapes)
        return [ins[-1] + out]
    return fn(ctx, node, ins, out_shapes)


# -- forward kernels ---------------------------------------------------------------------

def _linear(x, w):
    return F.linear(x, w)


def chunk_positions(layout: str, rank: int, n: int, seq: int, rows: int, chunk: int = 0,
                    chunks: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """Sequence position of each of ``rows`` rows of token chunk ``chunk`` (of ``chunks``) on ``rank``.

    L = seq/(n*chunks) tokens per rank and chunk; rank r's chunk j holds positions
    r*seq/n + j*L + [0, L). layout 'shard': this rank's own L rows. 'full': the chunk gathered
    from all n ranks, rank-major (n*L rows). 'chunk_major': all chunks of the gathered
    sequence one after another (seq rows), which is how chunked attention sees it.
    With chunks == 1 these are the plain positions: shard r is r*seq/n + [0, seq/n), full is [0, seq).
    ``device``: where the positions are built (the device of the rows they index).
    """
    local = seq // (n * chunks)
    i = torch.arange(rows, device=device)
    if layout == "shard":
        return rank * (seq // n) + chunk * local + i
    if layout == "full":
        return (i // local) * (seq // n) + chunk * local + i % local
    if layout == "chunk_major":
        j, within = i // (n * local), i % (n * local)
        return (within // local) * (seq // n) + j * local + within % local
    raise ValueError(f"position layout {layout!r} is not one of 'shard', 'full', 'chunk_major'")


def _cached(ctx: RankContext, key: tuple, make: Callable[[], Any]) -> Any:
    hit = ctx.tables.get(key)
    if hit is None:
        hit = ctx.tables[key] = make()
    return hit


def _rope_tables(ctx: RankContext, node: Node, rows: int, dim: int, like: torch.Tensor):
    """cos, sin [rows, dim] at this node's positions (``chunk_positions``) in ``like``'s dtype and
    device: the same for the node's forward, its backward and every step (``RankContext.tables``)."""
    layout, theta = node.typed.positions, node.typed.theta
    chunk, chunks = (node.typed.chunk or 0), node.typed.chunks
    inv, scaling = node.typed.inv_freq, node.typed.scaling          # the rotary module's (structural lowering)
    if ctx.tokens is not None and ctx.tokens.positions is not None:  # the batch's own positions: [b, rows, dim]
        return family_kernels.cos_sin(_positions(ctx, node, rows, like.device), dim, theta, like.dtype, inv, scaling)
    return _cached(ctx, ("rope", layout, rows, chunk, chunks, dim, theta, inv, scaling, like.dtype, like.device),
                   lambda: family_kernels.cos_sin(chunk_positions(layout, *ctx.seq_shard, ctx.seq, rows, chunk, chunks,
                                                                  device=like.device), dim, theta, like.dtype, inv,
                                                  scaling))


def _positions(ctx: RankContext, node: Node, rows: int, device) -> torch.Tensor:
    """The RoPE positions of the node's rows: [rows], or [b, rows] for a batch with position_ids."""
    return rope_positions(ctx.tokens, chunk_positions(node.typed.positions, *ctx.seq_shard, ctx.seq, rows,
                                                      node.typed.chunk or 0, node.typed.chunks, device=device))


def _chunk_order(ctx: RankContext, rows: int, chunks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-major rows' sequence positions and, for each position p, the row holding it."""
    pos = chunk_positions("chunk_major", *ctx.seq_shard, ctx.seq, rows, chunks=chunks, device=device)
    return pos, torch.argsort(pos)


def _rope_fwd(ctx: RankContext, node: Node, q, k):
    d, S = node.typed.head_dim, q.shape[1]
    b = q.shape[0]
    if node.typed.rotary_dim is not None or node.typed.interleave:   # partial or pair-interleaved rotation
        pos = _positions(ctx, node, S, q.device)
        rot = lambda x: family_kernels.rotate(node, x.view(b, S, -1, d), pos, d).reshape(b, S, -1)  # noqa: E731
        return rot(q), rot(k)
    cos, sin = _rope_tables(ctx, node, S, d, q)
    rot = lambda x: apply_rope(x.view(b, S, -1, d), cos, sin).reshape(b, S, -1)  # noqa: E731
    return rot(q), rot(k)


def _attention_fwd(ctx: RankContext, node: Node, *qkv):
    """Causal GQA attention over the whole sequence, given as N chunks each of q, k, v.

    Chunked inputs arrive chunk-major (see chunk_positions); rows are put in sequence order,
    attended with the plain causal mask and put back, so the result equals the unchunked one.
    Returns the N output chunks.
    """
    d, N = node.typed.head_dim, node.typed.chunks
    q, k, v = (torch.cat(qkv[i * N:(i + 1) * N], dim=1) for i in range(3))
    b, S = q.shape[:2]
    if N > 1:
        pos, order = _cached(ctx, ("chunk_major", S, N, q.device), lambda: _chunk_order(ctx, S, N, q.device))
        q, k, v = q[:, order], k[:, order], v[:, order]
    dv = node.typed.v_head_dim or d                                    # MLA: values narrower than q/k heads
    sinks = qkv[3 * N] if node.typed.sinks else None                   # GPT-OSS: one input after q, k, v
    if ctx.tokens is not None and S != ctx.seq:
        raise ValueError(f"node {node.name!r} attends over {S} rows, not the sequence of {ctx.seq}: a padded or "
                         "packed batch's mask needs the whole sequence")
    out = family_kernels.attend(node, q.view(b, S, -1, d), k.view(b, S, -1, d), v.view(b, S, -1, dv), sinks,
                                ctx.tokens)
    if N > 1:
        out = out[:, pos]
    return tuple(out.chunk(N, dim=1)) if N > 1 else (out,)


def _swiglu_fwd(a, b):
    return F.silu(a) * b




def _k_rmsnorm(ctx, node, ins, shapes):
    x, w = ins
    return [rms_norm(x, w + node.typed.offset if node.typed.offset else w, node.typed.eps)]


def _k_gemm(ctx, node, ins, shapes):
    return [_linear(*ins)]


def _k_split(ctx, node, ins, shapes):
    mode = node.typed.mode
    if mode == "concat":                                                # chunks -> one buffer
        return [torch.cat(ins, dim=node.typed.dim)]
    if mode == "split":
        return list(torch.split(ins[0], list(node.typed.sizes), dim=node.typed.dim))
    if mode == "heads":        # each head's features cut by sizes: [.., X*sum] -> [.., X*size_i] copies
        return [p.flatten(-2) for p in ins[0].unflatten(-1, (-1, sum(node.typed.sizes))).split(node.typed.sizes, -1)]
    raise bad_choice(node)


def _k_rope(ctx, node, ins, shapes):
    return list(_rope_fwd(ctx, node, *ins))


def _k_attention(ctx, node, ins, shapes):
    return list(_attention_fwd(ctx, node, *ins))


def _k_add(ctx, node, ins, shapes):
    """a + b; or, with attr reduce_dim, the sum (reduce="mean": the mean) of one input over that dim,
    accumulated in FP32 (the local sum after a compressed all-to-all)."""
    dim = node.typed.reduce_dim
    if dim is None:
        if len(ins) == 2:
            return [ins[0] + ins[1]]
        total = ins[0].clone()                  # n-ary (the aux loss's sum of the routers' stats)
        for t in ins[1:]:
            total += t
        return [total]
    acc, how = ins[0].float(), node.typed.reduce
    if how not in ("sum", "mean"):
        raise ValueError(f"node {node.name!r}: reduce={how!r} is not one of 'sum', 'mean'")
    acc = acc.mean(dim) if how == "mean" else acc.sum(dim)
    return [acc.to(ins[0].dtype if node.typed.to is None else TORCH_DTYPES[node.typed.to])]


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8": torch.float8_e4m3fn, "int64": torch.int64, "int32": torch.int32}
FP8_MAX = 448.0                                                         # largest finite E4M3 value


def _k_cast(ctx, node, ins, shapes):
    """Precision change. attr to: target dtype. scale="per_token": quantize x [..., h] to
    (x / s in fp8, s [...] fp32) with s = amax over h / FP8_MAX; scale="apply": the inverse
    (inputs x, s). The interpreter keeps the rounding: CAST to bf16 and back loses bits."""
    to = TORCH_DTYPES[node.typed.to]
    mode = node.typed.scale
    if mode is None:
        return [ins[0].to(to)]
    if mode == "per_token":
        x = ins[0].float()
        s = (x.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return [(x / s[..., None]).to(to), s]
    if mode == "apply":
        x, s = ins
        return [(x.float() * s[..., None]).to(to)]
    raise ValueError(f"cast scale {mode!r} (node {node.name!r}) is not one of 'per_token', 'apply'")


def _k_swiglu(ctx, node, ins, shapes):
    if node.typed.row_weights:
        a, b, row_w = ins
        return [scale_rows(_swiglu_fwd(a, b), row_w)]
    return [_swiglu_fwd(*ins)]


def _k_router(ctx, node, ins, shapes):
    weights, experts = route_tokens(node, *ins)
    if node.typed.aux:                          # the aux loss's stats (moegraph.edges)
        return [weights, experts, aux_stats(node, ins, _router_keep(ctx, node, ins[0]))]
    return [weights, experts]


def _router_keep(ctx, node, x):
    """Which of an aux router's rows [b, S, h] the aux loss counts: [b*S] fp32 0/1 of a padded
    batch (its attention mask at the rows' positions, ``chunk_positions``), None: every row."""
    if ctx.tokens is None or ctx.tokens.keys is None:
        return None
    pos = chunk_positions(node.typed.aux_positions, *ctx.seq_shard, ctx.seq, x.shape[1], node.typed.chunk or 0,
                          node.typed.aux_chunks, device=x.device)                   # [S]
    return ctx.tokens.keys[:, pos].reshape(-1).float()                              # [b, S] -> [b*S]


def _k_index_map(ctx, node, ins, shapes):
    return [build_index_map(ins[0], node.typed.layout, node.typed.experts_per_rank, ctx.rank, ctx.n,
                            ctx.expert_rows, node_ranks=node.typed.node_ranks)]


def _k_permute(ctx, node, ins, shapes):
    x, imap = ins
    index = node.typed.index
    if index == "slot":                                                 # [T, k] routing weights -> [R]
        return [x.reshape(-1)[imap.flat]]
    if index == "token":
        return [tokens(x)[imap.tokens]]                                # [T, h] -> [R, h]
    raise bad_choice(node)


def _k_unpermute(ctx, node, ins, shapes):
    if node.typed.weighted:
        rows, weights, imap = ins
        rows = rows * weights.reshape(-1)[imap.flat, None].to(rows.dtype)
    else:
        rows, imap = ins
    if imap.sources is not None:                    # a relay's received tokens: a data-dependent count
        return [rows.new_zeros((imap.sources, rows.shape[1])).index_add(0, imap.tokens, rows)]   # [R, h] -> [Rn', h]
    out = rows.new_zeros((_tokens_count(shapes[0]), rows.shape[1]))
    return [out.index_add(0, imap.tokens, imap.real_rows(rows)).view(shapes[0])]   # [R, h] -> [b, S, h]


def _tokens_count(shape):
    t = 1
    for d in shape[:-1]:
        t *= d
    return t


def _k_gate(ctx, node, ins, shapes):
    return [scale_rows(*ins)]


def _k_bias(ctx, node, ins, shapes):
    x, b = ins
    return [x + b.to(x.dtype)]


def _k_sigmoid_gate(ctx, node, ins, shapes):
    x, logit = ins                                                      # [..., h], [..., 1]
    return [x * torch.sigmoid(logit)]


def _square_sum(x):
    return x.float().pow(2).sum(-1, keepdim=True)


def _rmsnorm_sharded_fwd(node: Node, x, w, ss):
    """RMSNorm of a row split across ranks: ss is the all-reduced sum of squares of the whole row
    (width elements), so every rank normalises its slice by the full row's RMS."""
    r = torch.rsqrt(ss / node.typed.width + node.typed.eps)
    return (w + node.typed.offset if node.typed.offset else w) * (x.float() * r).to(x.dtype)


def _k_square_sum(ctx, node, ins, shapes):
    return [_square_sum(ins[0])]


def _k_rmsnorm_sharded(ctx, node, ins, shapes):
    return [_rmsnorm_sharded_fwd(node, *ins)]


def _mla_heads_fwd(ctx: RankContext, node: Node, q, kv, k_pe):
    """q [b, S, Hl*(dn+dr)], kv [b, S, Hl*(dn+dv)], k_pe [b, S, dr] -> query, key [b, S, Hl*(dn+dr)],
    value [b, S, Hl*dv]: query = (q_nope, rope(q_rot)), key = (k_nope, rope(k_pe)) with the one
    k_pe shared by every head. Interleaved RoPE (pairs 2i, 2i+1) equals rotate-half RoPE on the
    de-interleaved vector (evens, then odds), which is also the layout it returns (as transformers')."""
    t = node.typed
    Hl, dn, dr, dv = t.heads, t.nope_dim, t.rope_dim, t.v_dim
    b, S = q.shape[:2]
    q_nope, q_rot = q.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    k_nope, v = kv.view(b, S, Hl, dn + dv).split((dn, dv), dim=-1)
    k_rot = k_pe.view(b, S, 1, dr)
    if node.typed.interleave:
        q_rot, k_rot = (torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1) for t in (q_rot, k_rot))
    cos, sin = _rope_tables(ctx, node, S, dr, q)
    q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
    query = torch.cat((q_nope, q_rot), dim=-1).reshape(b, S, -1)
    key = torch.cat((k_nope, k_rot.expand(b, S, Hl, dr)), dim=-1).reshape(b, S, -1)
    return query, key, v.reshape(b, S, -1)


def _k_mla_heads(ctx, node, ins, shapes):
    return list(_mla_heads_fwd(ctx, node, *ins))


def _k_mla_heads_dgrad(ctx, node, ins, shapes):
    # the transpose of each forward step: RoPE rotates back (-sin, as ROPE's backward), the
    # de-interleave is undone, k_pe's broadcast over the heads sums, the splits concatenate
    q, dquery, dkey, dvalue = ins[0], *ins[3:]
    t = node.typed
    Hl, dn, dr, dv = t.heads, t.nope_dim, t.rope_dim, t.v_dim
    b, S = q.shape[:2]
    dq_nope, dq_rot = dquery.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    dk_nope, dk_rot = dkey.view(b, S, Hl, dn + dr).split((dn, dr), dim=-1)
    cos, sin = _rope_tables(ctx, node, S, dr, q)
    dq_rot = apply_rope(dq_rot, cos, -sin)
    dk_rot = apply_rope(dk_rot.sum(2, keepdim=True), cos, -sin)                   # [b, S, 1, dr]
    if node.typed.interleave:                                                      # evens, odds -> pairs
        dq_rot, dk_rot = (torch.stack(t.split(dr // 2, dim=-1), dim=-1).flatten(-2) for t in (dq_rot, dk_rot))
    dq = torch.cat((dq_nope, dq_rot), dim=-1).reshape(b, S, -1)
    dkv = torch.cat((dk_nope, dvalue.view(b, S, Hl, dv)), dim=-1).reshape(b, S, -1)
    return [dq, dkv, dk_rot.reshape(b, S, dr)]


def _k_grouped_gemm(ctx, node, ins, shapes):
    x, w, seg = ins
    return [grouped_rows(x, w, seg)]


# -- backward kernels ---------------------------------------------------------------------


def _k_gemm_dgrad(ctx, node, ins, shapes):
    dy, w = ins
    return [dy @ w]


def _k_gemm_wgrad(ctx, node, ins, shapes):
    x, dy = ins
    return [tokens(dy).T @ tokens(x)]


def _k_grouped_dgrad(ctx, node, ins, shapes):
    dy, w, seg = ins
    return [grouped_rows(dy, w, seg, transpose_w=True)]


def _k_grouped_wgrad(ctx, node, ins, shapes):
    x, dy, seg = ins
    return [grouped_weight_grad(x, dy, seg, shapes[0])]


def _k_rmsnorm_dgrad(ctx, node, ins, shapes):
    # y = w * x r with r = rsqrt(mean(x^2) + eps):  dx = r (g - x̂ mean(g x̂)), g = dy w, x̂ = x r
    x, w, dy = ins
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + node.typed.eps)
    xhat, g = xf * r, dy.float() * (w.float() + node.typed.offset)
    return [(r * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)]


def _k_rmsnorm_wgrad(ctx, node, ins, shapes):
    x, dy = ins
    normed = rms_norm(x, x.new_ones(x.shape[-1]), node.typed.eps)
    return [(tokens(dy) * tokens(normed)).sum(0)]


def _k_split_dgrad(ctx, node, ins, shapes):
    mode = node.typed.mode
    if mode == "concat":                                                # one buffer -> chunk grads
        return list(torch.split(ins[0], list(node.typed.sizes), dim=node.typed.dim))
    if mode == "split":
        return [torch.cat(ins, dim=node.typed.dim)]
    if mode == "heads":        # the parts' gradients interleaved back per head: [.., X*size_i] -> [.., X*sum]
        return [torch.cat([d.unflatten(-1, (-1, k)) for d, k in zip(ins, node.typed.sizes)], -1).flatten(-2)]
    raise bad_choice(node)


def _k_rope_dgrad(ctx, node, ins, shapes):
    # RoPE rotates each (i, i + d/2) pair by a position angle; its transpose rotates back, which is
    # RoPE with -sin (sin is the same in both halves, so the rotate-half sign flip commutes).
    dq, dk = ins
    d, S, b = node.typed.head_dim, dq.shape[1], dq.shape[0]
    if node.typed.rotary_dim is not None or node.typed.interleave:
        pos = _positions(ctx, node, S, dq.device)
        back = lambda x: family_kernels.rotate(node, x.view(b, S, -1, d), pos, d,  # noqa: E731
                                               inverse=True).reshape(b, S, -1)
        return [back(dq), back(dk)]
    cos, sin = _rope_tables(ctx, node, S, d, dq)
    back = lambda x: apply_rope(x.view(b, S, -1, d), cos, -sin).reshape(b, S, -1)  # noqa: E731
    return [back(dq), back(dk)]


def _k_attention_dgrad(ctx, node, ins, shapes):
    N = node.typed.chunks                                               # ins: q, k, v, o, do; N chunks each
    m = 3 * N + (1 if node.typed.sinks else 0)                          # + the sinks [H/n] after q, k, v
    qkv, do = ins[:m], tuple(ins[m + N:m + 2 * N])
    return pullback(lambda *t: _attention_fwd(ctx, node, *t), qkv, do)


def _k_swiglu_dgrad(ctx, node, ins, shapes):
    # y = silu(a) b:  da = silu'(a) (dy b),  db = dy silu(a); aten's fused silu_backward is one pass
    if node.typed.row_weights:     # y = silu(a) b w: the rows' dy is dy w; dw = sum_f dy silu(a) b
        a, b, row_w, dy = ins
        dy_rows = scale_rows(dy, row_w)
        return [torch.ops.aten.silu_backward(dy_rows * b, a), dy_rows * F.silu(a),
                (dy * _swiglu_fwd(a, b)).sum(-1).to(row_w.dtype)]
    a, b, dy = ins
    return [torch.ops.aten.silu_backward(dy * b, a), dy * F.silu(a)]


def _k_router_dgrad(ctx, node, ins, shapes):
    return router_pullback(node, 0, ins, _router_keep(ctx, node, ins[0]) if node.typed.aux else None)


def _k_router_wgrad(ctx, node, ins, shapes):
    # w, or the logit bias / per-expert scale (inputs after w: choice bias, logit bias, expert scale)
    wrt, scaled = node.typed.wrt, node.typed.expert_scale
    primal = -1 if wrt == "expert_scale" else (-2 if scaled else -1) if wrt == "logit_bias" else 1
    return router_pullback(node, primal, ins, _router_keep(ctx, node, ins[0]) if node.typed.aux else None)


def _k_permute_dgrad(ctx, node, ins, shapes):
    drows, imap = ins
    drows = imap.real_rows(drows)                                       # a padded map's padding adds nothing
    index = node.typed.index
    # a relay's received tokens (map layout in_node) are a data-dependent count, not the planning shape's
    shape = shapes[0] if imap.sources is None else (imap.sources, *shapes[0][1:])
    if index == "slot":                                                 # [R] -> [T, k], zero where unrouted here
        out = drows.new_zeros(math.prod(shape))
        return [out.index_add(0, imap.flat, drows).view(shape)]
    if index == "token":
        out = drows.new_zeros((_tokens_count(shape), drows.shape[1]))
        return [out.index_add(0, imap.tokens, drows).view(shape)]       # k copies summed per token
    raise bad_choice(node)


def _k_unpermute_dgrad(ctx, node, ins, shapes):
    if not node.typed.weighted:
        dy, imap = ins
        return [tokens(dy)[imap.tokens]]
    dy, rows, weights, imap = ins
    dy_rows = tokens(dy)[imap.tokens]                                  # [R, h]
    w_rows = weights.reshape(-1)[imap.flat]
    drows = dy_rows * w_rows[:, None].to(dy_rows.dtype)
    dweights = torch.zeros_like(weights).reshape(-1)
    # padding rows of a padded map are other ranks' slots: they must stay zero here
    dweights[imap.flat] = imap.real_rows((dy_rows * rows).sum(-1)).to(weights.dtype)
    return [drows, dweights.view_as(weights)]


def _k_bias_wgrad(ctx, node, ins, shapes):
    (dy,) = ins
    return [tokens(dy).sum(0)]                                          # [..., X] -> [X]


def _k_sigmoid_gate_dgrad(ctx, node, ins, shapes):
    # y = x sig(g):  dx = dy sig(g),  dg = sum_h(dy x) sig(g) (1 - sig(g))
    x, logit, dy = ins
    sig = torch.sigmoid(logit)
    return [dy * sig, (dy * x).sum(-1, keepdim=True) * sig * (1 - sig)]


def _k_square_sum_dgrad(ctx, node, ins, shapes):
    x, dss = ins
    return [(2 * x.float() * dss).to(x.dtype)]


def _k_rmsnorm_sharded_dgrad(ctx, node, ins, shapes):
    # gradient of the slice and of ss; this rank's dss is partial (ss is shared across ranks): the
    # ALL_REDUCE's backward sums it before SQUARE_SUM's backward reads it
    x, w, ss, dy = ins
    return pullback(lambda x_, ss_: _rmsnorm_sharded_fwd(node, x_, w, ss_), (x, ss), (dy,))


def _k_rmsnorm_sharded_wgrad(ctx, node, ins, shapes):
    x, w, ss, dy = ins
    return pullback(lambda w_: _rmsnorm_sharded_fwd(node, x, w_, ss), (w,), (dy,))


def _k_gate_dgrad(ctx, node, ins, shapes):
    dy, rows, gates = ins
    return [scale_rows(dy, gates), (dy * rows).sum(-1).to(gates.dtype)]


KERNELS: dict[tuple[OpKind, Role], Callable] = {
    (OpKind.RMSNORM, Role.FORWARD): _k_rmsnorm,
    (OpKind.GEMM, Role.FORWARD): _k_gemm,
    (OpKind.SPLIT, Role.FORWARD): _k_split,
    (OpKind.ROPE, Role.FORWARD): _k_rope,
    (OpKind.ATTENTION, Role.FORWARD): _k_attention,
    (OpKind.ADD, Role.FORWARD): _k_add, (OpKind.ADD, Role.DGRAD): _k_add, (OpKind.ADD, Role.WGRAD): _k_add,
    (OpKind.SWIGLU, Role.FORWARD): _k_swiglu,
    (OpKind.ROUTER, Role.FORWARD): _k_router,
    (OpKind.INDEX_MAP, Role.FORWARD): _k_index_map,
    (OpKind.PERMUTE, Role.FORWARD): _k_permute,
    (OpKind.UNPERMUTE, Role.FORWARD): _k_unpermute,
    (OpKind.GATE, Role.FORWARD): _k_gate,
    (OpKind.CAST, Role.FORWARD): _k_cast, (OpKind.CAST, Role.WGRAD): _k_cast,
    (OpKind.CAST, Role.DGRAD): _k_cast,           # compress=ep-fp8: the combine's gradient sent in FP8
    (OpKind.GROUPED_GEMM, Role.FORWARD): _k_grouped_gemm,
    (OpKind.GEMM, Role.DGRAD): _k_gemm_dgrad,
    (OpKind.GEMM, Role.WGRAD): _k_gemm_wgrad,
    (OpKind.GROUPED_GEMM, Role.DGRAD): _k_grouped_dgrad,
    (OpKind.GROUPED_GEMM, Role.WGRAD): _k_grouped_wgrad,
    (OpKind.RMSNORM, Role.DGRAD): _k_rmsnorm_dgrad,
    (OpKind.RMSNORM, Role.WGRAD): _k_rmsnorm_wgrad,
    (OpKind.SPLIT, Role.DGRAD): _k_split_dgrad,
    (OpKind.ROPE, Role.DGRAD): _k_rope_dgrad,
    (OpKind.ATTENTION, Role.DGRAD): _k_attention_dgrad,
    (OpKind.SWIGLU, Role.DGRAD): _k_swiglu_dgrad,
    (OpKind.ROUTER, Role.DGRAD): _k_router_dgrad,
    (OpKind.ROUTER, Role.WGRAD): _k_router_wgrad,
    (OpKind.PERMUTE, Role.DGRAD): _k_permute_dgrad,
    (OpKind.UNPERMUTE, Role.DGRAD): _k_unpermute_dgrad,
    (OpKind.GATE, Role.DGRAD): _k_gate_dgrad,
    (OpKind.BIAS, Role.FORWARD): _k_bias, (OpKind.BIAS, Role.WGRAD): _k_bias_wgrad,
    (OpKind.SIGMOID_GATE, Role.FORWARD): _k_sigmoid_gate,
    (OpKind.SIGMOID_GATE, Role.DGRAD): _k_sigmoid_gate_dgrad,
    (OpKind.SQUARE_SUM, Role.FORWARD): _k_square_sum,
    (OpKind.SQUARE_SUM, Role.DGRAD): _k_square_sum_dgrad,
    (OpKind.RMSNORM_SHARDED, Role.FORWARD): _k_rmsnorm_sharded,
    (OpKind.RMSNORM_SHARDED, Role.DGRAD): _k_rmsnorm_sharded_dgrad,
    (OpKind.RMSNORM_SHARDED, Role.WGRAD): _k_rmsnorm_sharded_wgrad,
    (OpKind.MLA_HEADS, Role.FORWARD): _k_mla_heads,
    (OpKind.MLA_HEADS, Role.DGRAD): _k_mla_heads_dgrad,
}

# the structural lowering's ops (NORM, GLU, SCALE, GROUPED_BIAS): registered from their own module
from moegraph import family_kernels  # noqa: E402
KERNELS.update(family_kernels.KERNELS)
