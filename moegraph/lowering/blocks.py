"""Strategy-dependent lowering of the three MoE-layer blocks into forward IR nodes.

Notation (MegaScale-MoE Table 1):
    b: micro-batch  s: sequence  h: hidden  n: group size  k: top-k  m: q/kv head ratio
    f: h_ffn/h      E: experts   H: query heads  G: kv heads (H/m)  d: head dim (h/H)
    T: tokens seen by the router on this rank   R: expert rows on this rank (balanced: b*s*k/n)

Contract between blocks: every block consumes and produces the sequence-sharded activation
[b, s/n, h] (sequence-parallel norms and residuals, as Megatron-SP and MegaScale-MoE do).
Operator granularity follows Fig 9. Collectives of a group of 1 are not emitted.

Block specs name the module parameters a block reads; a model family's rule file only has to
fill these specs from its module (see lowering/reference.py, lowering/hf_mixtral.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from moegraph.builder import GraphBuilder, ring_bytes
from moegraph.ir import OpKind, ParamSource, ParamSpec, ValueKind

ATTN, FFN = "attention", "ffn"
INDEX_DTYPE, WEIGHT_DTYPE = "int64", "fp32"


@dataclass(frozen=True)
class NormSpec:
    weight: ParamSource
    eps: float


@dataclass(frozen=True)
class AttentionSpec:
    q: ParamSource            # [H*d, h]
    k: ParamSource            # [G*d, h]
    v: ParamSource            # [G*d, h]
    o: ParamSource            # [h, H*d]
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    tuple_output: bool = False   # the module returns (output, attention weights), as transformers' do


@dataclass(frozen=True)
class MoESpec:
    router: ParamSource       # [E, h]
    w1: ParamSource           # [E, h_ffn, h] gate projection
    w3: ParamSource           # [E, h_ffn, h] up projection
    w2: ParamSource           # [E, h, h_ffn] down projection
    experts: int
    top_k: int
    ffn_hidden: int
    hidden: int


def _numel(g: GraphBuilder, v: str) -> int:
    n = 1
    for d in g.shape(v):
        n *= d
    return n


def emit_gemm(g: GraphBuilder, name: str, x: str, w: str, out: str, *, module: str, block: str) -> str:
    """y = x @ w.T with w stored [out, in] like nn.Linear. [..., K] -> [..., N]."""
    n_out, k_in = g.shape(w)
    y = g.value(out, g.shape(x)[:-1] + (n_out,))
    m_rows = _numel(g, x) // k_in
    g.node(name, OpKind.GEMM, (x, w), (y,), flops=2 * m_rows * n_out * k_in, module=module, block=block)
    return y


def emit_all_gather(g: GraphBuilder, name: str, x: str, out: str, *, dim: int, module: str, block: str) -> str:
    """Gather the sequence shards: [b, s/n, ...] -> [b, s, ...]."""
    if g.strategy.n == 1:
        return x
    shape = list(g.shape(x))
    shape[dim] *= g.strategy.n
    y = g.value(out, tuple(shape))
    g.collective(name, OpKind.ALL_GATHER, (x,), (y,), comm_bytes=ring_bytes(g.nbytes(y), g.strategy.n),
                 attrs={"dim": dim}, module=module, block=block)
    return y


def emit_reduce_scatter(g: GraphBuilder, name: str, x: str, out: str, *, dim: int, module: str, block: str) -> str:
    """Sum partial results across the group and keep this rank's shard: [b, s, ...] -> [b, s/n, ...]."""
    if g.strategy.n == 1:
        return x
    shape = list(g.shape(x))
    shape[dim] //= g.strategy.n
    y = g.value(out, tuple(shape))
    g.collective(name, OpKind.REDUCE_SCATTER, (x,), (y,), comm_bytes=ring_bytes(g.nbytes(x), g.strategy.n),
                 flops=_numel(g, x), attrs={"dim": dim}, module=module, block=block)
    return y


def emit_rmsnorm(g: GraphBuilder, spec: NormSpec, x: str, *, name: str, out: str, module: str, block: str) -> str:
    """[b, s/n, h] -> [b, s/n, h]; the weight is replicated (its gradient is all-reduced)."""
    h = g.shape(x)[-1]
    w = g.param(f"{name}.weight", (h,), ParamSpec((spec.weight,), shard_dim=None))
    y = g.like(out, x)
    g.node(name, OpKind.RMSNORM, (x, w), (y,), flops=4 * _numel(g, x), attrs={"eps": spec.eps},
           module=module, block=block)
    return y


def emit_add(g: GraphBuilder, a: str, b: str, *, name: str, out: str, module: str, block: str) -> str:
    y = g.like(out, a)
    g.node(name, OpKind.ADD, (a, b), (y,), flops=_numel(g, a), module=module, block=block)
    return y


def emit_attention(g: GraphBuilder, spec: AttentionSpec, x: str, *, module: str) -> str:
    """Attention with RoPE and GQA under attn='tp' (Megatron TP + SP norms) or 'sp' (Ulysses)."""
    n, tp = g.strategy.n, g.strategy.attn == "tp"
    H, G, d = spec.heads, spec.kv_heads, spec.head_dim
    b, s, h = g.dims.b, g.dims.s, g.dims.h
    Hl, Gl = (H // n, G // n) if tp else (H, G)          # heads this rank's QKV projection produces
    kw = dict(module=module, block=ATTN)

    w_qkv = g.param("qkv.weight", ((Hl + 2 * Gl) * d, h),
                    ParamSpec((spec.q, spec.k, spec.v), shard_dim=0 if tp else None))
    x_in = emit_all_gather(g, "ln1_ag", x, "ln1_out_ag", dim=1, **kw) if tp else x   # [b, s/n, h] -> [b, s, h]
    qkv = emit_gemm(g, "qkv_proj", x_in, w_qkv, "qkv", **kw)                         # [b, S, (Hl+2Gl)d]
    S = g.shape(qkv)[1]
    q = g.value("q", (b, S, Hl * d), alias_of=qkv)
    k = g.value("k", (b, S, Gl * d), alias_of=qkv)
    v = g.value("v", (b, S, Gl * d), alias_of=qkv)
    g.node("qkv_split", OpKind.SPLIT, (qkv,), (q, k, v), mem_bytes=0,
           attrs={"dim": 2, "sizes": (Hl * d, Gl * d, Gl * d)}, **kw)
    q_rope, k_rope = g.like("q_rope", q), g.like("k_rope", k)
    g.node("rope", OpKind.ROPE, (q, k), (q_rope, k_rope), flops=3 * (_numel(g, q) + _numel(g, k)),
           attrs={"head_dim": d, "theta": spec.rope_theta, "positions": "full" if tp else "shard"}, **kw)
    if tp or n == 1:
        qa, ka, va = q_rope, k_rope, v
    else:
        # Ulysses: split heads, gather sequence. [b, s/n, X*d] -> [b, s, X/n*d] for X in (H, G, G)
        qa = g.value("q_a2a", (b, s, H // n * d))
        ka = g.value("k_a2a", (b, s, G // n * d))
        va = g.value("v_a2a", (b, s, G // n * d))
        g.collective("qkv_a2a", OpKind.ALL_TO_ALL, (q_rope, k_rope, v), (qa, ka, va),
                     comm_bytes=ring_bytes(g.nbytes(q_rope, k_rope, v), n),
                     attrs={"mode": "heads", "split_dim": 2, "cat_dim": 1}, **kw)
    attn = g.value("attn", (b, s, H // n * d))            # either way each rank attends over H/n heads
    g.node("attention", OpKind.ATTENTION, (qa, ka, va), (attn,), flops=2 * b * s * s * (H // n) * d,
           attrs={"head_dim": d, "causal": True}, **kw)
    if tp:
        w_o = g.param("o_proj.weight", (h, Hl * d), ParamSpec((spec.o,), shard_dim=1))
        partial = emit_gemm(g, "out_proj", attn, w_o, "attn_out_partial" if n > 1 else "attn_out", **kw)
        return emit_reduce_scatter(g, "attn_rs", partial, "attn_out", dim=1, **kw)  # [b, s, h] -> [b, s/n, h]
    attn_a2a = attn
    if n > 1:
        # Ulysses back: split sequence, gather heads. [b, s, H/n*d] -> [b, s/n, H*d]
        attn_a2a = g.value("attn_a2a", (b, s // n, H * d))
        g.collective("attn_a2a", OpKind.ALL_TO_ALL, (attn,), (attn_a2a,), comm_bytes=ring_bytes(g.nbytes(attn), n),
                     attrs={"mode": "heads", "split_dim": 1, "cat_dim": 2}, **kw)
    w_o = g.param("o_proj.weight", (h, H * d), ParamSpec((spec.o,), shard_dim=None))
    return emit_gemm(g, "out_proj", attn_a2a, w_o, "attn_out", **kw)


def emit_moe(g: GraphBuilder, spec: MoESpec, x: str, *, module: str) -> str:
    """Router, dispatch, SwiGLU experts and combine under ffn='tp'|'ep' and dispatch='a2a'|'ag-rs'."""
    n, ep, a2a = g.strategy.n, g.strategy.ffn == "ep", g.strategy.dispatch == "a2a"
    E, k, F = spec.experts, spec.top_k, spec.ffn_hidden
    b, s, h = g.dims.b, g.dims.s, g.dims.h
    El, Fl = (E // n, F) if ep else (E, F // n)           # experts and h_ffn columns on this rank
    kw = dict(module=module, block=FFN)

    w_router = g.param("router.weight", (E, h), ParamSpec((spec.router,), shard_dim=None))
    w1 = g.param("w1", (El, Fl, h), ParamSpec((spec.w1,), shard_dim=0 if ep else 1))
    w3 = g.param("w3", (El, Fl, h), ParamSpec((spec.w3,), shard_dim=0 if ep else 1))
    w2 = g.param("w2", (El, h, Fl), ParamSpec((spec.w2,), shard_dim=0 if ep else 2))

    tokens_in = x if a2a else emit_all_gather(g, "ln2_ag", x, "ln2_out_ag", dim=1, **kw)  # [b, s/n, h] -> [b, s, h]
    T = _numel(g, tokens_in) // h
    R = T * k if (a2a or not ep) else T * k // n        # balanced expectation of expert rows here
    topk_w = g.value("topk_weights", (T, k), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE)
    topk_idx = g.value("topk_experts", (T, k), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
    g.node("router", OpKind.ROUTER, (tokens_in, w_router), (topk_w, topk_idx),
           flops=2 * T * h * E + 5 * T * E, attrs={"top_k": k, "experts": E}, **kw)
    layout = "by_dest" if a2a else ("local" if ep else "all")
    imap = g.value("index_map", (R,), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
    g.node("index_map", OpKind.INDEX_MAP, (topk_idx,), (imap,), flops=T * k,
           attrs={"layout": layout, "experts_per_rank": El, "top_k": k}, **kw)

    rows = g.value("ffn_in_send" if a2a else "ffn_in", (R, h), routed=True)
    g.node("dispatch_scatter", OpKind.PERMUTE, (tokens_in, imap), (rows,), **kw)   # [T, h] -> [R, h]
    seg = imap
    if a2a and n > 1:
        ffn_in = g.value("ffn_in", (R, h), routed=True)
        seg = g.value("recv_map", (n, El), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
        g.collective("dispatch_a2a", OpKind.ALL_TO_ALL, (rows, imap), (ffn_in, seg),
                     comm_bytes=ring_bytes(g.nbytes(rows), n),
                     attrs={"mode": "tokens", "direction": "to_experts", "emit_map": True}, **kw)
        rows = ffn_in
    fc1 = _grouped_gemm(g, "fc1", rows, w1, seg, "fc1_out", **kw)                 # [R, h] -> [R, f*h/(n if tp)]
    fc3 = _grouped_gemm(g, "fc3", rows, w3, seg, "fc3_out", **kw)
    fc2_in = g.like("fc2_in", fc1)
    g.node("swiglu", OpKind.SWIGLU, (fc1, fc3), (fc2_in,), flops=5 * _numel(g, fc1), **kw)
    fc2_out = _grouped_gemm(g, "fc2", fc2_in, w2, seg, "fc2_out", **kw)          # [R, Fl] -> [R, h]
    if a2a and n > 1:
        back = g.value("fc2_out_a2a", (R, h), routed=True)
        g.collective("combine_a2a", OpKind.ALL_TO_ALL, (fc2_out, seg), (back,),
                     comm_bytes=ring_bytes(g.nbytes(fc2_out), n),
                     attrs={"mode": "tokens", "direction": "from_experts"}, **kw)
        fc2_out = back
    combined_name = "ffn_out" if (a2a or n == 1) else "fc2_out_rs"
    combined = g.value(combined_name, g.shape(tokens_in))
    g.node("combine_gather", OpKind.UNPERMUTE, (fc2_out, topk_w, imap), (combined,),
           flops=2 * R * h, attrs={"weighted": True}, **kw)                       # [R, h] -> [b, S, h]
    if a2a:
        return combined
    return emit_reduce_scatter(g, "ffn_rs", combined, "ffn_out", dim=1, **kw)     # [b, s, h] -> [b, s/n, h]


def _grouped_gemm(g: GraphBuilder, name: str, rows: str, w: str, seg: str, out: str, **kw) -> str:
    """Per-expert y = x @ w[e].T over row segments. [R, K] -> [R, N], w: [El, N, K]."""
    _, n_out, k_in = g.shape(w)
    r = g.shape(rows)[0]
    y = g.value(out, (r, n_out), routed=True)
    g.node(name, OpKind.GROUPED_GEMM, (rows, w, seg), (y,), flops=2 * r * n_out * k_in, **kw)
    return y
