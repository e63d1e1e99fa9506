"""Strategy-dependent lowering of the three MoE-layer blocks into forward IR nodes.

Notation (MegaScale-MoE Table 1):
    b: micro-batch  s: sequence  h: hidden  n: group size  k: top-k  m: q/kv head ratio
    f: h_ffn/h      E: experts   H: query heads  G: kv heads (H/m)  d: head dim (h/H)
    T: tokens the expert rows come from (a2a: this rank's b*s/n; ag-rs: the gathered b*s)
    R: expert rows on this rank (balanced: b*s*k/n)
    N: token chunks (Strategy.chunks)           L: local tokens per chunk, s/(nN)

Contract between blocks: every block consumes and produces the sequence-sharded activation
[b, s/n, h] (sequence-parallel norms and residuals, as Megatron-SP and MegaScale-MoE do); [b/N, s/G, h]
with Strategy.attn_nodes = N (moegraph.token_layout; the attention lowered in GraphBuilder.attention_group).
Operator granularity follows Fig 9. Collectives of a group of 1 are not emitted.

Strategy fields read here besides attn/ffn/dispatch/n:
  chunks  N > 1 splits the block's local tokens [b, s/n, h] into N views of [b, L, h]; each
          chunk runs its own comm/compute chain (nodes and values get a ``.c{j}`` suffix and
          attr ``chunk=j``) so a scheduler can overlap chunk j's collective with chunk j+1's
          compute. Attention chunks the QKV GEMM (+ all-gather or all-to-all) and the
          (all-to-all or) output GEMM (+ reduce-scatter); the attention core still runs once
          over the whole sequence (it reads all chunks). The MoE block is token-wise, so each
          chunk is a whole router -> dispatch -> experts -> combine chain. Chunk results are
          written into one output buffer (values ``alias_of`` it) that a zero-copy concat
          (SPLIT node, attr mode="concat") hands on.
          Sequence order inside a gathered chunk is rank-major (rank 0's L tokens, rank 1's,
          ...), so after the gather the sequence is chunk-major; RoPE and the causal mask use
          each row's true position (kernels.chunk_positions).
  gate    "after-fc2": the combine multiplies expert rows by their routing weight (weighted
          UNPERMUTE), so FC2's output is needed for the weight gradient.
          "before-fc2" (MegaScale-MoE §4.1, Megatron-Core "memory-efficient permutation"):
          SwiGLU's kernel scales its output rows by their routing weights before FC2 (one
          pass, as MegaScale fuses it; SWIGLU/GLU attr row_weights) and the combine is an
          unweighted sum.
          Under all-to-all dispatch the per-row weights travel to the experts in an extra
          small all-to-all (R fp32 values).

Routing: the ROUTER reads this rank's own tokens under every dispatch; ag-rs gathers its result
(``moegraph.lowering.routing``).

Block specs name the module parameters a block reads; a model family's rule file only has to
fill these specs (``moegraph.lowering.specs``) from its module (see lowering/reference.py,
lowering/structural.py).
"""

from __future__ import annotations

import math

import contextlib
from moegraph.builder import ConfigError, GraphBuilder
from moegraph.efficiency import attention_attrs, gemm_attrs
from moegraph.family_kernels import attention_pairs
from moegraph.ir import OpKind, ParamSource, ParamSpec, ValueKind
from moegraph.lowering.blocks_ext import (WEIGHT_DTYPE, emit_bias, emit_glu, emit_grouped_bias, emit_head_norm,
                                          emit_layernorm, emit_limit, emit_out_gate, emit_rmsnorm, emit_scale,
                                          emit_width_norm, expert_bias_params, head_norms, mask_attrs, out_gate_param,
                                          position_attrs as _position_attrs, split_heads, ulysses_in as _ulysses_in)
from moegraph.lowering import node_dispatch
from moegraph.lowering.expert_rows import grouped_gemm, row_weights
from moegraph.lowering.routing import INDEX_DTYPE, gather_routing, route_local_tokens, router_input
from moegraph.lowering.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec, RopeSpec  # noqa: F401

ATTN, FFN = "attention", "ffn"


def _numel(g: GraphBuilder, v: str) -> int:
    n = 1
    for d in g.shape(v):
        n *= d
    return n


def check_layout(g: GraphBuilder) -> None:
    """Reject chunk counts the layer's sequence cannot be split into, naming every factor (the
    strategy's own fields, gate, chunks >= 1 and dp >= 1 included, are valid by construction:
    ``Strategy.__post_init__``)."""
    st = g.strategy
    local = g.dims.s // st.n
    if local % st.chunks:
        raise ConfigError(f"chunks={st.chunks} does not divide the local sequence s/n={local} "
                          f"(s={g.dims.s}, n={st.n})")


def _sfx(j: int, chunks: int) -> str:
    return f".c{j}" if chunks > 1 else ""


@contextlib.contextmanager
def _chunk(g: GraphBuilder, j: int, chunks: int):
    """Tag every node emitted inside the block with attr chunk=j (when chunking)."""
    start = len(g.nodes)
    yield _sfx(j, chunks)
    if chunks > 1:
        g.nodes[start:] = [n.with_attrs(chunk=j) for n in g.nodes[start:]]


def _split_chunks(g: GraphBuilder, name: str, x: str, *, module: str, block: str) -> list[str]:
    """[b, s/n, h] -> N views [b, L, h] along the sequence (no copy); [x] when N == 1."""
    N = g.strategy.chunks
    if N == 1:
        return [x]
    shape = g.shape(x)
    size = shape[1] // N
    outs = [g.value(f"{x}.c{j}", (shape[0], size) + shape[2:], alias_of=x) for j in range(N)]
    g.node(name, OpKind.SPLIT, (x,), outs, mem_bytes=0, attrs={"dim": 1, "sizes": (size,) * N, "mode": "split"},
           module=module, block=block)
    return outs


def _concat_chunks(g: GraphBuilder, name: str, parts: list[str], out: str, *, module: str, block: str) -> str:
    """N chunk results, each written into its slice of ``out``: [b, L, h] x N -> [b, s/n, h].

    A SPLIT node with mode="concat": the chunks are views of ``out`` already, so it moves no
    bytes; it exists so that readers of ``out`` depend on every chunk.
    """
    if len(parts) == 1:
        return parts[0]
    sizes = tuple(g.shape(p)[1] for p in parts)
    g.node(name, OpKind.SPLIT, tuple(parts), (out,), mem_bytes=0,
           attrs={"dim": 1, "sizes": sizes, "mode": "concat"}, module=module, block=block)
    return out


def _chunk_out(g: GraphBuilder, base: str, j: int) -> tuple[str, str | None]:
    """(value name, alias) for chunk j's share of a concatenated output ``base``."""
    if g.strategy.chunks == 1:
        return base, None
    return f"{base}.c{j}", base


def emit_gemm(g: GraphBuilder, name: str, x: str, w: str, out: str, *, module: str, block: str,
              alias_of: str | None = None) -> str:
    """y = x @ w.T with w stored [out, in] like nn.Linear. [..., K] -> [..., N]."""
    n_out, k_in = g.shape(w)
    y = g.value(out, g.shape(x)[:-1] + (n_out,), alias_of=alias_of)
    m_rows = _numel(g, x) // k_in
    g.node(name, OpKind.GEMM, (x, w), (y,), flops=2 * m_rows * n_out * k_in, module=module, block=block,
           attrs=gemm_attrs(g.shape(x), g.shape(w)))
    return y


def emit_all_gather(g: GraphBuilder, name: str, x: str, out: str, *, dim: int, module: str, block: str) -> str:
    """Gather the sequence shards: [b, s/n, ...] -> [b, s, ...]."""
    if g.strategy.n == 1:
        return x
    shape = list(g.shape(x))
    shape[dim] *= g.strategy.n
    y = g.value(out, tuple(shape))
    g.collective(name, OpKind.ALL_GATHER, (x,), (y,), full_bytes=g.nbytes(y),
                 attrs={"dim": dim}, module=module, block=block)
    return y


def emit_reduce_scatter(g: GraphBuilder, name: str, x: str, out: str, *, dim: int, module: str, block: str,
                        alias_of: str | None = None) -> str:
    """Sum partial results across the group and keep this rank's shard: [b, s, ...] -> [b, s/n, ...]."""
    if g.strategy.n == 1:
        return x
    shape = list(g.shape(x))
    shape[dim] //= g.strategy.n
    y = g.value(out, tuple(shape), alias_of=alias_of)
    g.collective(name, OpKind.REDUCE_SCATTER, (x,), (y,), full_bytes=g.nbytes(x),
                 flops=_numel(g, x), attrs={"dim": dim}, module=module, block=block)
    return y


def emit_add(g: GraphBuilder, a: str, b: str, *, name: str, out: str, module: str, block: str) -> str:
    y = g.like(out, a)
    g.node(name, OpKind.ADD, (a, b), (y,), flops=_numel(g, a), module=module, block=block)
    return y


def emit_attention(g: GraphBuilder, spec: AttentionSpec, x: str, *, module: str) -> str:
    """Attention with RoPE and GQA under attn='tp' (Megatron TP + SP norms) or 'sp' (Ulysses)."""
    check_layout(g)
    if spec.temperature_floor is not None and g.dims.s >= spec.temperature_floor:
        raise ConfigError(f"{module}: attention temperature tuning (Llama 4's NoPE layers) scales q by log(position) "
                          f"from position floor_scale - 1 = {spec.temperature_floor - 1} on, which is not modelled: "
                          f"lowered for s < {spec.temperature_floor} only (s={g.dims.s}), or set "
                          "config.attn_temperature_tuning=False")
    n, tp = g.strategy.n, g.strategy.attn == "tp"
    H, G, d = spec.heads, spec.kv_heads, spec.head_dim
    dv = spec.v_head_dim or d
    b, h = g.dims.b, g.dims.h
    Hl, Gl = (H // n, G // n) if tp else (H, G)          # heads this rank's QKV projection produces
    kw = dict(module=module, block=ATTN)
    q_gate = spec.out_gate is not None and spec.out_gate.weight is None    # q_proj's rows per head: q, gate
    Hq = 2 * Hl if q_gate else Hl                         # q_proj's rows, in heads of d

    Vl = 0 if spec.v_from_k else Gl * dv             # value rows the projection has (none: v is k's, Gemma 4)
    w_qkv = g.param("qkv.weight", ((Hq + Gl) * d + Vl, h),
                    ParamSpec((spec.q, spec.k) + (() if spec.v_from_k else (spec.v,)), shard_dim=0 if tp else None))
    b_qkv = None
    if spec.qkv_bias is not None:      # cut exactly like the weight's rows: [(Hq+Gl)d + Gl dv]
        b_qkv = g.param("qkv.bias", ((Hq + Gl) * d + Vl,), ParamSpec(spec.qkv_bias, shard_dim=0 if tp else None))
    # q/k norm weights [H*d], [G*d]: cut like the projection's rows (this rank's heads under tp);
    # per-head norms' [d] (Qwen3) replicated; one weight for every token chunk
    w_qk = tuple(None if ns is None
                 else g.param(f"{name}.weight", (d,), ParamSpec((ns.weight,), shard_dim=None)) if spec.qk_norm_per_head
                 else g.param(f"{name}.weight", (X // n * d if tp else X * d,),
                              ParamSpec((ns.weight,), shard_dim=0 if tp else None))
                 for name, ns, X in (("q_norm", spec.q_norm, H), ("k_norm", spec.k_norm, G)))
    rope_attrs = {"head_dim": d, "theta": spec.rope_theta} | _position_attrs(g) | spec.rotary.attrs()
    qs, ks, vs, xs = [], [], [], []                      # xs: the output gate's inputs (x, or its logits)
    for c, x_in in _attention_chunks(g, x, kw):
        xs.append(x_in)
        qkv = emit_gemm(g, f"qkv_proj{c}", x_in, w_qkv, f"qkv{c}", **kw)            # [b, S, (Hl+Gl)d + Gl dv]
        if b_qkv is not None:
            biased = g.like(f"qkv_biased{c}", qkv)
            g.node(f"qkv_bias{c}", OpKind.BIAS, (qkv, b_qkv), (biased,), flops=_numel(g, qkv), **kw)
            qkv = biased
        if spec.qkv_clip is not None:
            qkv = emit_limit(g, qkv, "clamp", spec.qkv_clip, name=f"qkv_clip{c}", out=f"qkv_clipped{c}", **kw)
        S = g.shape(qkv)[1]
        q = g.value(f"q{c}", (b, S, Hq * d), alias_of=qkv)
        k = g.value(f"k{c}", (b, S, Gl * d), alias_of=qkv)
        v = k if spec.v_from_k else g.value(f"v{c}", (b, S, Gl * dv), alias_of=qkv)
        parts = (q, k) if spec.v_from_k else (q, k, v)
        g.node(f"qkv_split{c}", OpKind.SPLIT, (qkv,), parts, mem_bytes=0,
               attrs={"dim": 2, "sizes": tuple(g.shape(p)[2] for p in parts), "mode": "split"}, **kw)
        if q_gate:                                     # [b, S, Hl*2d] -> q, the gate's logits [b, S, Hl*d]
            q, xs[-1] = split_heads(g, q, (d, d), (f"q_only{c}", f"attn_gate_logit{c}"), name=f"q_gate_split{c}", kw=kw)
        if spec.v_norm_eps is not None:          # Gemma 4: a weightless RMSNorm of each value head
            v = emit_head_norm(g, None, v, name=f"v_norm{c}", head_dim=dv, kw=kw, l2_eps=spec.v_norm_eps)
        if spec.v_scale != 1.0:
            v = emit_scale(g, v, spec.v_scale, name=f"v_scale{c}", out=f"v_scaled{c}", **kw)
        if spec.qk_norm_per_head and not spec.qk_norm_after_rope:
            q, k = head_norms(g, spec, q, k, c, kw, w_qk)
        elif spec.q_norm is not None and not spec.qk_norm_per_head:
            q = emit_width_norm(g, spec.q_norm, q, f"q_norm{c}", w_qk[0], H * d, kw)
            k = emit_width_norm(g, spec.k_norm, k, f"k_norm{c}", w_qk[1], G * d, kw)
        if spec.use_rope:
            q_rope, k_rope = g.like(f"q_rope{c}", q), g.like(f"k_rope{c}", k)
            g.node(f"rope{c}", OpKind.ROPE, (q, k), (q_rope, k_rope), flops=3 * (_numel(g, q) + _numel(g, k)),
                   attrs=rope_attrs, **kw)
            q, k = q_rope, k_rope
        if spec.qk_norm_after_rope:
            q, k = head_norms(g, spec, q, k, c, kw, w_qk)
        qa, ka, va = _ulysses_in(g, q, k, v, c, kw)
        qs.append(qa), ks.append(ka), vs.append(va)
    y = _attend_and_project(g, qs, ks, vs, spec.o, heads=H, qk_dim=d, v_dim=dv, kw=kw, spec=spec, gate_ins=xs)
    if spec.o_bias is None:
        return y
    return emit_bias(g, y, spec.o_bias, name="o_bias", out="attn_out_biased", **kw)


def emit_mla(g: GraphBuilder, spec: MLASpec, x: str, *, module: str) -> str:
    """Multi-head latent attention (see MLASpec) under attn='tp' or 'sp'; r_q, r_kv: the q and kv ranks,
    dq = dn + dr the q/k head dim, dv the value head dim.

    The down projections q_a [r_q, h] and kv_a [r_kv + dr, h] and their norms are replicated: under
    tp every rank computes the latents of all gathered tokens (as Megatron-Core's MLA does), so their
    gradients are partial per rank and all-reduced like the norms'. The up projections q_b, kv_b
    are cut by heads (tp) and o by its input columns; under sp every rank runs the whole block on
    its own tokens and Ulysses moves heads as for plain attention. MLA_HEADS assembles each head's
    query (q_nope, rope(q_rot)), key (k_nope, rope(k_pe)) and value.
    """
    check_layout(g)
    if spec.query_scale_from is not None and g.dims.s > spec.query_scale_from:
        raise ConfigError(f"{module}: its query scale 1 + beta log(1 + floor(p / {spec.query_scale_from})) (Mistral 4's "
                          f"llama_4_scaling_beta) departs from 1 at position {spec.query_scale_from}, which is not "
                          f"modelled: lowered for s <= {spec.query_scale_from} only (s={g.dims.s})")
    n, tp = g.strategy.n, g.strategy.attn == "tp"
    H, dn, dr, dv, dq = spec.heads, spec.nope_dim, spec.rope_dim, spec.v_dim, spec.qk_dim
    h = g.dims.h
    Hl = H // n if tp else H
    kw = dict(module=module, block=ATTN)
    rep = lambda name, shape, src: g.param(name, shape, ParamSpec((src,), shard_dim=None))  # noqa: E731
    by_heads = lambda name, shape, src: g.param(name, shape, ParamSpec((src,), shard_dim=0 if tp else None))  # noqa: E731
    if spec.q_rank is None:
        w_q = by_heads("q_proj.weight", (Hl * dq, h), spec.q)
    else:
        w_qa = rep("q_a_proj.weight", (spec.q_rank, h), spec.q_a)
        w_qn = rep("q_a_norm.weight", (spec.q_rank,), spec.q_norm.weight)
        w_qb = by_heads("q_b_proj.weight", (Hl * dq, spec.q_rank), spec.q_b)
    w_kva = rep("kv_a_proj.weight", (spec.kv_rank + dr, h), spec.kv_a)
    w_kvn = rep("kv_a_norm.weight", (spec.kv_rank,), spec.kv_norm.weight)
    w_kvb = by_heads("kv_b_proj.weight", (Hl * (dn + dv), spec.kv_rank), spec.kv_b)
    heads_attrs = {"heads": Hl, "nope_dim": dn, "rope_dim": dr, "v_dim": dv, "theta": spec.rope_theta,
                   "interleave": spec.rope_interleave} | _position_attrs(g) | (
        {k: v for k, v in spec.rope.attrs().items() if k in ("inv_freq", "scaling")} if spec.rope else {})
    qs, ks, vs = [], [], []
    for c, x_in in _attention_chunks(g, x, kw):
        if spec.q_rank is None:
            q = emit_gemm(g, f"q_proj{c}", x_in, w_q, f"q{c}", **kw)                       # [b, S, Hl*dq]
        else:
            cq = emit_gemm(g, f"q_a_proj{c}", x_in, w_qa, f"q_latent{c}", **kw)            # [b, S, r_q]
            cq = emit_width_norm(g, spec.q_norm, cq, f"q_a_norm{c}", w_qn, spec.q_rank, kw)
            q = emit_gemm(g, f"q_b_proj{c}", cq, w_qb, f"q{c}", **kw)                      # [b, S, Hl*dq]
        ckv = emit_gemm(g, f"kv_a_proj{c}", x_in, w_kva, f"kv_latent_pe{c}", **kw)         # [b, S, r_kv+dr]
        b, S = g.shape(ckv)[:2]
        ckv_c = g.value(f"kv_latent{c}", (b, S, spec.kv_rank), alias_of=ckv)
        k_pe = g.value(f"k_pe{c}", (b, S, dr), alias_of=ckv)
        g.node(f"kv_a_split{c}", OpKind.SPLIT, (ckv,), (ckv_c, k_pe), mem_bytes=0,
               attrs={"dim": 2, "sizes": (spec.kv_rank, dr), "mode": "split"}, **kw)
        ckv_c = emit_width_norm(g, spec.kv_norm, ckv_c, f"kv_a_norm{c}", w_kvn, spec.kv_rank, kw)
        kv = emit_gemm(g, f"kv_b_proj{c}", ckv_c, w_kvb, f"kv{c}", **kw)                   # [b, S, Hl*(dn+dv)]
        qh, kh = g.value(f"q_heads{c}", (b, S, Hl * dq)), g.value(f"k_heads{c}", (b, S, Hl * dq))
        vh = g.value(f"v_heads{c}", (b, S, Hl * dv))
        g.node(f"mla_heads{c}", OpKind.MLA_HEADS, (q, kv, k_pe), (qh, kh, vh),
               flops=3 * b * S * (Hl + 1) * dr, attrs=heads_attrs, **kw)                    # RoPE; the rest moves
        qa, ka, va = _ulysses_in(g, qh, kh, vh, c, kw)
        qs.append(qa), ks.append(ka), vs.append(va)
    return _attend_and_project(g, qs, ks, vs, spec.o, heads=H, qk_dim=dq, v_dim=dv, kw=kw, spec=spec)


def emit_mlp(g: GraphBuilder, spec: MLPSpec, x: str, *, module: str) -> str:
    """A dense layer's SwiGLU MLP: [b, s/n, h] -> [b, s/n, h]. There is no router and no dispatch.

    ffn='tp': Megatron tensor parallelism with sequence-parallel edges: all-gather the tokens,
    column-parallel w1/w3 ([f/n, h] per rank), row-parallel w2 ([h, f/n]), reduce-scatter.
    ffn='ep' (no experts to place): every rank runs the whole MLP on its own tokens with replicated
    weights whose gradients are all-reduced, like the shared expert (``dispatch`` plays no part).
    """
    check_layout(g)
    if spec.gate is not None:
        raise ConfigError(f"{module}: a dense layer MLP with a sigmoid gate is not supported")
    kw = dict(module=module, block=FFN)
    if g.strategy.ffn != "tp":
        return _emit_shared_expert(g, spec, x, kw, prefix="mlp")
    N, h, f = g.strategy.chunks, g.dims.h, spec.ffn_hidden // g.strategy.n
    w1 = g.param("mlp.w1", (f, h), ParamSpec((spec.w1,), shard_dim=0))
    w3 = g.param("mlp.w3", (f, h), ParamSpec((spec.w3,), shard_dim=0))
    w2 = g.param("mlp.w2", (h, f), ParamSpec((spec.w2,), shard_dim=1))
    out_full = g.value("ffn_out", g.shape(x)) if N > 1 else None
    outs = []
    for j, xj in enumerate(_split_chunks(g, "ln2_split", x, **kw)):      # [b, s/n, h] -> N x [b, L, h]
        with _chunk(g, j, N) as c:
            name, alias = _chunk_out(g, "ffn_out", j)
            x_in = emit_all_gather(g, f"ln2_ag{c}", xj, f"ln2_out_ag{c}", dim=1, **kw)      # [b, nL, h]
            a = emit_gemm(g, f"fc1{c}", x_in, w1, f"fc1_out{c}", **kw)                       # [b, nL, f/n]
            u = emit_gemm(g, f"fc3{c}", x_in, w3, f"fc3_out{c}", **kw)
            act = emit_glu(g, f"swiglu{c}", a, u, f"fc2_in{c}", spec.activation, kw, limit=spec.swiglu_limit,
                           alpha=spec.swiglu_alpha)
            if g.strategy.n == 1:
                outs.append(emit_gemm(g, f"fc2{c}", act, w2, name, alias_of=alias, **kw))
                continue
            partial = emit_gemm(g, f"fc2{c}", act, w2, f"fc2_out{c}", **kw)                  # [b, nL, h] partial
            outs.append(emit_reduce_scatter(g, f"ffn_rs{c}", partial, name, dim=1, alias_of=alias, **kw))
    return _concat_chunks(g, "ffn_out_concat", outs, out_full, **kw) if N > 1 else outs[0]


def _attention_chunks(g: GraphBuilder, x: str, kw: dict):
    """Yield (suffix, tokens) per token chunk of the block input, with the chunk's nodes tagged
    while the caller emits them: [b, s/n, h] -> N x [b, L, h], all-gathered to [b, nL, h] under tp."""
    for j, xj in enumerate(_split_chunks(g, "ln1_split", x, **kw)):
        with _chunk(g, j, g.strategy.chunks) as c:
            tp = g.strategy.attn == "tp"
            yield c, (emit_all_gather(g, f"ln1_ag{c}", xj, f"ln1_out_ag{c}", dim=1, **kw) if tp else xj)


def _attend_and_project(g: GraphBuilder, qs: list[str], ks: list[str], vs: list[str], o: ParamSource, *,
                        heads: int, qk_dim: int, v_dim: int, kw: dict, spec=None, gate_ins: list[str] = ()) -> str:
    """Causal attention over H/n heads and the whole sequence (N chunks each of q, k, v:
    [b, s/N, H/n*d_qk], ..., [b, s/N, H/n*d_v]), then the output projection back to this rank's
    sequence shard [b, s/n, h] (tp: a reduce-scatter of partial sums; sp: Ulysses back first).
    A gated output (``spec.out_gate``) multiplies o_proj's input by act(g_proj(x)), x the chunk's
    QKV input ``gate_ins[j]`` (tp: the gathered tokens, g_proj cut by heads like q; sp: this
    rank's tokens, g_proj replicated like q)."""
    n, tp, N = g.strategy.n, g.strategy.attn == "tp", g.strategy.chunks
    b, s, h = g.dims.b, g.dims.s, g.dims.h
    H, d, dv = heads, qk_dim, v_dim
    Hl = H // n if tp else H
    attns = [g.value(f"attn{_sfx(j, N)}", (b, s // N, H // n * dv)) for j in range(N)]
    attrs = attention_attrs(seq=s, head_dim=d) | {"causal": True} | ({"v_head_dim": dv} if dv != d else {}) | ({"chunks": N} if N > 1 else {})
    # QK^T and PV over the causal half: (d + dv) b s^2 H/n
    flops, extra, mask = b * s * s * (H // n) * (d + dv), (), mask_attrs(spec)
    if mask.get("window") or mask.get("chunk_size"):  # only the pairs the mask keeps: 2 (d + dv) b H/n pairs
        flops = 2 * b * (H // n) * (d + dv) * attention_pairs(s, mask.get("window"), mask.get("chunk_size"))
    if getattr(spec, "sinks", None) is not None:      # [H] cut by heads: this rank attends H/n of them
        extra = (g.param("sinks", (H // n,), ParamSpec((spec.sinks,), shard_dim=0)),)
    g.node("attention", OpKind.ATTENTION, (*qs, *ks, *vs, *extra), tuple(attns), flops=flops,
           attrs=attrs | mask, **kw)
    out_full = g.value("attn_out", (b, s // n, h)) if N > 1 else None
    outs = []
    w_o = g.param("o_proj.weight", (h, Hl * dv), ParamSpec((o,), shard_dim=1 if tp else None))
    gate = getattr(spec, "out_gate", None)
    fused = gate is not None and gate.weight is None      # the logits came with q (Qwen3-Next): gate_ins
    w_gate = out_gate_param(g, gate, Hl, dv) if gate is not None and not fused else None
    for j, attn in enumerate(attns):
        with _chunk(g, j, N) as c:
            name, alias = _chunk_out(g, "attn_out", j)
            if not tp and n > 1:
                # Ulysses back: split sequence, gather heads. [b, nL, H/n*d] -> [b, L, H*d]
                attn_a2a = g.value(f"attn_a2a{c}", (b, s // n // N, H * dv))
                g.collective(f"attn_a2a{c}", OpKind.ALL_TO_ALL, (attn,), (attn_a2a,),
                             full_bytes=g.nbytes(attn),
                             attrs={"mode": "heads", "split_dim": 1, "cat_dim": 2}, **kw)
                attn = attn_a2a
            if gate is not None:                      # [b, S, Hl] or [b, S, Hl*dv] logits
                logit = gate_ins[j] if fused else emit_gemm(g, f"attn_gate_proj{c}", gate_ins[j], w_gate,
                                                            f"attn_gate_logit{c}", **kw)
                attn = emit_out_gate(g, gate, logit, attn, dv, name=f"attn_gate{c}", out=f"attn_gated{c}", kw=kw)
            if not tp or n == 1:
                outs.append(emit_gemm(g, f"out_proj{c}", attn, w_o, name, alias_of=alias, **kw))
                continue
            partial = emit_gemm(g, f"out_proj{c}", attn, w_o, f"attn_out_partial{c}", **kw)
            outs.append(emit_reduce_scatter(g, f"attn_rs{c}", partial, name, dim=1, alias_of=alias,
                                            **kw))                           # [b, nL, h] -> [b, L, h]
    return _concat_chunks(g, "attn_out_concat", outs, out_full, **kw) if N > 1 else outs[0]


def emit_moe(g: GraphBuilder, spec: MoESpec, x: str, *, module: str) -> str:
    """Router, dispatch, SwiGLU experts and combine under ffn='tp'|'ep' and dispatch='a2a'|'ag-rs'."""
    check_layout(g)
    N = g.strategy.chunks
    kw = dict(module=module, block=FFN)
    w_router = g.param("router.weight", (spec.experts, g.dims.h), ParamSpec((spec.router,), shard_dim=None))
    router_ins: tuple[str, ...] = (w_router,)
    if spec.score_bias is not None:   # a buffer: read for the expert choice, never differentiated
        router_ins += (g.param("router.score_bias", (spec.experts,),
                               ParamSpec((spec.score_bias,), shard_dim=None, buffer=True)),)
    if spec.router_bias is not None:  # trained, added to the logits (GPT-OSS): replicated like the weight
        router_ins += (g.param("router.bias", (spec.experts,), ParamSpec((spec.router_bias,), shard_dim=None)),)
    if spec.expert_scale is not None:  # trained, times each chosen weight (Gemma 4): replicated like the weight
        router_ins += (g.param("router.expert_scale", (spec.experts,), ParamSpec((spec.expert_scale,), shard_dim=None)),)
    ep = g.strategy.ffn == "ep"
    El, Fl = (spec.experts // g.strategy.n, spec.ffn_hidden) if ep else (spec.experts, spec.ffn_hidden // g.strategy.n)
    weights = (g.param("w1", (El, Fl, g.dims.h), ParamSpec((spec.w1,), shard_dim=0 if ep else 1)),
               g.param("w3", (El, Fl, g.dims.h), ParamSpec((spec.w3,), shard_dim=0 if ep else 1)),
               g.param("w2", (El, g.dims.h, Fl), ParamSpec((spec.w2,), shard_dim=0 if ep else 2)))
    if spec.expert_bias is not None:
        weights += expert_bias_params(g, spec.expert_bias, El, Fl, ep)
    out_full = g.value("ffn_out", g.shape(x)) if N > 1 else None
    # Gemma 4: the experts read their own norm of the block input, the router another (_router_input)
    x_routed = x if spec.routed_norm is None else emit_rmsnorm(g, spec.routed_norm, x, name="moe_in_norm",
                                                                out="moe_in_normed", **kw)
    x_router = router_input(g, spec, x, kw)
    routers = None if x_router == x_routed else _split_chunks(g, "router_split", x_router, **kw)
    outs = []
    for j, xj in enumerate(_split_chunks(g, "ln2_split", x_routed, **kw)):      # [b, s/n, h] -> N x [b, L, h]
        with _chunk(g, j, N) as c:
            outs.append(_emit_moe_chunk(g, spec, xj, router_ins, weights, El, c, j, kw,
                                        xj if routers is None else routers[j]))
    y = _concat_chunks(g, "ffn_out_concat", outs, out_full, **kw) if N > 1 else outs[0]
    if spec.routed_post_norm is not None:     # the routed experts' own output norm (Gemma 4)
        y = emit_rmsnorm(g, spec.routed_post_norm, y, name="moe_routed_norm", out="moe_routed_normed", **kw)
    if spec.shared is not None:
        shared = _emit_shared_expert(g, spec.shared, x, kw)
        routed, y = y, g.like("moe_out", y)
        g.node("shared_add", OpKind.ADD, (routed, shared), (y,), flops=_numel(g, routed), **kw)
        if spec.shared_average:           # (routed + shared) / 2 (Cohere2-MoE's 'average' combination)
            y = emit_scale(g, y, 0.5, name="shared_average", out="moe_avg_out", **kw)
    if spec.post_norm is not None:        # the block's own output norm, on [b, s/n, h] (A.X-K1)
        y = emit_rmsnorm(g, spec.post_norm, y, name="moe_post_norm", out="moe_normed", **kw)
    return y


def _emit_shared_expert(g: GraphBuilder, spec: MLPSpec, x: str, kw: dict, prefix: str = "shared") -> str:
    """The dense shared expert on this rank's own tokens: [b, s/n, h] -> [b, s/n, h].

    Sequence-parallel with replicated weights (their gradients are all-reduced, as the norms'):
    it reads only the block input, so nothing in it waits for the dispatch and the scheduler
    may run its GEMMs beside the dispatch and combine collectives (Megatron-Core's shared-expert
    overlap). Per rank: 3 GEMMs of 2*(b*s/n)*h*f_s FLOPs each, plus the gate's 2*(b*s/n)*h.
    """
    h, f = g.dims.h, spec.ffn_hidden
    rep = lambda src, shape, name: g.param(name, shape, ParamSpec((src,), shard_dim=None))  # noqa: E731
    if spec.input_norm is not None:          # Gemma 4's dense MLP: its own norm of the block input
        x = emit_rmsnorm(g, spec.input_norm, x, name=f"{prefix}_in_norm", out=f"{prefix}_in_normed", **kw)
    w1, w3 = rep(spec.w1, (f, h), f"{prefix}.w1"), rep(spec.w3, (f, h), f"{prefix}.w3")
    w2 = rep(spec.w2, (h, f), f"{prefix}.w2")
    a = emit_gemm(g, f"{prefix}_fc1", x, w1, f"{prefix}_fc1_out", **kw)                     # [b, s/n, f_s]
    b = emit_gemm(g, f"{prefix}_fc3", x, w3, f"{prefix}_fc3_out", **kw)
    act = emit_glu(g, f"{prefix}_swiglu", a, b, f"{prefix}_fc2_in", spec.activation, kw, limit=spec.swiglu_limit,
                   alpha=spec.swiglu_alpha)
    y = emit_gemm(g, f"{prefix}_fc2", act, w2, f"{prefix}_out", **kw)                        # [b, s/n, h]
    if spec.output_norm is not None:         # and its own output norm (a gate beside it: refused when read)
        return emit_rmsnorm(g, spec.output_norm, y, name=f"{prefix}_out_norm", out=f"{prefix}_normed", **kw)
    if spec.gate is None:
        return y
    w_gate = rep(spec.gate, (1, h), "shared.gate")
    logit = emit_gemm(g, "shared_gate_proj", x, w_gate, "shared_gate_logit", **kw)    # [b, s/n, 1]
    gated = g.like("shared_out_gated", y)
    g.node("shared_gate", OpKind.SIGMOID_GATE, (y, logit), (gated,), flops=_numel(g, y) + 4 * _numel(g, logit), **kw)
    return gated


def _emit_moe_chunk(g: GraphBuilder, spec: MoESpec, x: str, router_ins: tuple[str, ...], weights: tuple[str, ...],
                    El: int, c: str, j: int, kw: dict, x_router: str) -> str:
    """One token chunk's whole MoE chain: [b, L, h] -> [b, L, h] (L = s/n when unchunked); the router
    reads x_router [b, L, h] (x, or its own norm of the block input: Gemma 4)."""
    n, ep, a2a = g.strategy.n, g.strategy.ffn == "ep", g.strategy.dispatch == "a2a"
    # where routing weights multiply: Llama 4 scales the expert's input rows (whatever the gate
    # strategy); else the strategy's gate: at the combine, or into SwiGLU's output before FC2
    before = g.strategy.gate == "before-fc2" and not spec.weighted_input
    k = spec.top_k
    h = g.dims.h
    w1, w3, w2, *biases = weights

    topk_w, topk_idx = route_local_tokens(g, spec, x_router, router_ins, c, kw)  # [b, L, k] each
    tokens_in = x
    if not a2a:
        # ag-rs: the (small) routing of every rank's tokens is gathered first, in the tokens' own
        # [b, nL] order, so the index map and the scatter's row selection are known before the token
        # all-gather lands: the AG+scatter+GroupedGEMM kernel's tile signals (MegaScale-MoE §4.2)
        topk_w, topk_idx = gather_routing(g, topk_w, topk_idx, c, kw)          # [b, L, k] -> [b, nL, k]
        tokens_in = emit_all_gather(g, f"ln2_ag{c}", x, f"ln2_out_ag{c}", dim=1, **kw)  # [b, L, h] -> [b, nL, h]
    T = _numel(g, tokens_in) // h
    R = T * k if (a2a or not ep) else T * k // n        # balanced expectation of expert rows here
    by_node = a2a and g.strategy.ep_nodes > 1           # the hierarchical dispatch (node_dispatch)
    if by_node:
        route = node_dispatch.dispatch(g, spec, tokens_in, topk_w, topk_idx, El, c, kw)
        rows, seg, imap = route.rows, route.seg, route.index_map
    else:
        layout = "by_dest" if a2a else ("local" if ep else "all")
        imap = g.value(f"index_map{c}", (R,), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE, routed=True)
        g.node(f"index_map{c}", OpKind.INDEX_MAP, (topk_idx,), (imap,), flops=T * k,
               attrs={"layout": layout, "experts_per_rank": El, "top_k": k}, **kw)
        rows = g.value(f"ffn_in_send{c}" if a2a else f"ffn_in{c}", (R, h), routed=True)
        # [T, h] -> [R, h]
        g.node(f"dispatch_scatter{c}", OpKind.PERMUTE, (tokens_in, imap), (rows,), attrs={"index": "token"}, **kw)
        seg = imap
    if a2a and n > 1 and not by_node:
        ffn_in = g.value(f"ffn_in{c}", (R, h), routed=True)
        seg = g.value(f"recv_map{c}", (n, El), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
        g.collective(f"dispatch_a2a{c}", OpKind.ALL_TO_ALL, (rows, imap), (ffn_in, seg),
                     full_bytes=g.nbytes(rows),
                     attrs={"mode": "tokens", "direction": "to_experts", "emit_map": True}, **kw)
        rows = ffn_in
    if spec.weighted_input:
        row_w = node_dispatch.row_weights(g, route, c, kw) if by_node else row_weights(g, topk_w, imap, R, c, kw)
        gated_in = g.like(f"ffn_in_gated{c}", rows)
        g.node(f"gate{c}", OpKind.GATE, (rows, row_w), (gated_in,), flops=_numel(g, rows), **kw)   # [R, h]
        rows = gated_in
    fc1 = grouped_gemm(g, f"fc1{c}", rows, w1, seg, f"fc1_out{c}", **kw)          # [R, h] -> [R, f*h/(n if tp)]
    fc3 = grouped_gemm(g, f"fc3{c}", rows, w3, seg, f"fc3_out{c}", **kw)
    if biases:                                                                      # GPT-OSS's expert biases
        fc1 = emit_grouped_bias(g, f"fc1_bias{c}", fc1, biases[0], seg, kw=kw)
        fc3 = emit_grouped_bias(g, f"fc3_bias{c}", fc3, biases[1], seg, kw=kw)
    if before:                                 # the routing weights scale SwiGLU's rows in its own kernel
        row_w = node_dispatch.row_weights(g, route, c, kw) if by_node else row_weights(g, topk_w, imap, R, c, kw)
    fc2_in = emit_glu(g, f"swiglu{c}", fc1, fc3, f"fc2_in{c}", spec.activation, kw, limit=spec.swiglu_limit,
                      alpha=spec.swiglu_alpha, row_weights=row_w if before else None)   # [R, Fl] x 2 (, [R]) -> [R, Fl]
    fc2_out = grouped_gemm(g, f"fc2{c}", fc2_in, w2, seg, f"fc2_out{c}", **kw)      # [R, Fl] -> [R, h]
    if biases:              # tp: each rank adds b2/n to its partial sums; gate before fc2: scaled like the rows
        fc2_out = emit_grouped_bias(g, f"fc2_bias{c}", fc2_out, biases[2], seg, share=1 if ep else n,
                                    row_weights=row_w if before else None, kw=kw)
    if by_node:
        final, alias = _chunk_out(g, "ffn_out", j)
        combined = g.value(final, g.shape(tokens_in), alias_of=alias)
        return node_dispatch.combine(g, route, fc2_out, combined, not (before or spec.weighted_input), c, kw)
    if a2a and n > 1:
        back = g.value(f"fc2_out_a2a{c}", (R, h), routed=True)
        g.collective(f"combine_a2a{c}", OpKind.ALL_TO_ALL, (fc2_out, seg), (back,),
                     full_bytes=g.nbytes(fc2_out),
                     attrs={"mode": "tokens", "direction": "from_experts"}, **kw)
        fc2_out = back
    final, alias = _chunk_out(g, "ffn_out", j)
    combined_name, combined_alias = (final, alias) if (a2a or n == 1) else (f"fc2_out_rs{c}", None)
    combined = g.value(combined_name, g.shape(tokens_in), alias_of=combined_alias)
    if before or spec.weighted_input:
        g.node(f"combine_gather{c}", OpKind.UNPERMUTE, (fc2_out, imap), (combined,),
               flops=R * h, attrs={"weighted": False}, **kw)                       # [R, h] -> [b, S, h]
    else:
        g.node(f"combine_gather{c}", OpKind.UNPERMUTE, (fc2_out, topk_w, imap), (combined,),
               flops=2 * R * h, attrs={"weighted": True}, **kw)                    # [R, h] -> [b, S, h]
    if a2a or n == 1:
        return combined
    return emit_reduce_scatter(g, f"ffn_rs{c}", combined, final, dim=1, alias_of=alias, **kw)  # [b, nL, h] -> [b, L, h]
