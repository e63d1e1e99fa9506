"""Strategy-dependent lowering of a linear-attention token mixer (Gated DeltaNet, Qwen3-Next's and
Qwen3.5-MoE's ``linear_attention`` layers; Kimi Delta Attention, Kimi Linear's: ``LinearAttentionSpec``)
into forward IR nodes.

Notation (as ``moegraph.lowering.blocks``): b micro-batch, s sequence, h hidden, n group size;
Hk key heads, Hv value heads (r = Hv/Hk), dk, dv their head dims, P = 2dk + 2r dv the features
of one key head's group in in_proj_qkvz's output (q, k, v, z), 2r in in_proj_ba's (b, a);
Hkl, Hvl = Hk/n, Hv/n the heads of one rank; C = 2 Hk dk + Hv dv convolved channels, K its width.

The recurrence runs over the whole sequence, so its core (GATED_DELTA: convolution, decay, delta
rule, gated norm; ``moegraph.delta_kernels``) runs head-sharded under both attention strategies,
as the softmax core does, and is exact there: every rank holds the whole sequence of its heads.
    tp  all-gather the tokens [b, s/n, h] -> [b, s, h]; in_proj_qkvz and in_proj_ba cut by key-head
        groups (their rows are grouped by key head, so a rank's Hkl groups carry its Hvl value
        heads); out_proj cut by its input columns, then a reduce-scatter of the partial sums.
    sp  this rank's tokens through the replicated projections, then Ulysses: an all-to-all splits
        the key-head groups and gathers the sequence, [b, s/n, Hk*P] -> [b, s, Hkl*P] (and ba); the
        core's output goes back, [b, s, Hvl*dv] -> [b, s/n, Hv*dv], before the replicated out_proj.
The core's weights are cut by heads under both (the conv's q, k and v channel rows, A_log and
dt_bias), the gated norm's weight [dv] is replicated (its partial gradients all-reduced).
Qwen3.5-MoE's four projections (layout 'flat': in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) are
one weight of P + 2r rows per key head, its rows each rank's share of the heads (``_flat_projection``).
Kimi Delta Attention (layout 'kda', ``_emit_kda``): q_proj, k_proj, v_proj and b_proj as one such
weight, its low-rank forget and output gates' down projections replicated and up projections cut by
heads under tp; the same all-to-all and core.
Token chunks (Strategy.chunks > 1) leave this block whole (its recurrence reads the whole sequence;
the layer's MoE block is still chunked). A folded attention (attn_nodes = N > 1: the builder's
attention group, b/N rows on n/N ranks) folds it alike: each row's recurrence is its own.
"""

from __future__ import annotations

from moegraph.builder import ConfigError, GraphBuilder
from moegraph.delta_kernels import gated_delta_flops, gated_delta_state_bytes
from moegraph.efficiency import attention_attrs
from moegraph.ir import OpKind, ParamSource, ParamSpec
from moegraph.lowering.blocks import ATTN, check_layout, emit_all_gather, emit_gemm, emit_reduce_scatter
from moegraph.lowering.specs import LinearAttentionSpec


def emit_linear_attention(g: GraphBuilder, spec: LinearAttentionSpec, x: str, *, module: str) -> str:
    """[b, s/n, h] -> [b, s/n, h] (module docstring)."""
    check_layout(g)
    st = g.strategy
    n, tp = st.n, st.attn == "tp"
    Hk, Hv, dk, dv, K = spec.k_heads, spec.v_heads, spec.k_dim, spec.v_dim, spec.conv_size
    # n/attn_nodes divides Hk: checked before any node (moegraph.tracer.lower), naming the key heads
    r, P = Hv // Hk, 2 * dk + 2 * (Hv // Hk) * dv
    Hkl, Hvl = Hk // n, Hv // n
    h = g.dims.h
    kw = dict(module=module, block=ATTN)
    proj = Hkl if tp else Hk                                  # key-head groups this rank's projections give
    # the conv's channel rows: q [Hk dk], k [Hk dk], v [Hv dv]; this rank's heads of each, concatenated
    rows = ((0, Hk * dk), (Hk * dk, Hk * dk), (2 * Hk * dk, Hv * dv))
    conv = tuple(ParamSource(spec.conv.qualname, narrow=(0, start, length)) for start, length in rows)
    if spec.layout == "kda":
        return _emit_kda(g, spec, x, conv, kw)
    if spec.layout == "flat":
        qkv = spec.qkvz.qualname
        pieces = ((qkv, 0, Hk * dk), (qkv, Hk * dk, Hk * dk), (qkv, 2 * Hk * dk, Hv * dv),
                  (spec.z.qualname, 0, Hv * dv), (spec.b.qualname, 0, Hv), (spec.a.qualname, 0, Hv))
        w_proj = (_flat_projection(g, pieces, Hk, P + 2 * r),)                               # [proj*(P+2r), h]
    elif spec.layout == "grouped":
        w_proj = (g.param("in_proj_qkvz.weight", (proj * P, h), ParamSpec((spec.qkvz,), shard_dim=0 if tp else None)),
                  g.param("in_proj_ba.weight", (proj * 2 * r, h), ParamSpec((spec.ba,), shard_dim=0 if tp else None)))
    else:
        raise ConfigError(f"{module}: linear-attention layout {spec.layout!r} is not one of 'grouped', 'flat', 'kda'")
    w_conv = g.param("conv1d.weight", (2 * Hkl * dk + Hvl * dv, 1, K), ParamSpec(conv, shard_dim=0))
    a_log = g.param("A_log", (Hvl,), ParamSpec((spec.a_log,), shard_dim=0))
    dt_bias = g.param("dt_bias", (Hvl,), ParamSpec((spec.dt_bias,), shard_dim=0))
    w_norm = g.param("norm.weight", (dv,), ParamSpec((spec.norm,), shard_dim=None))
    w_out = g.param("out_proj.weight", (h, (Hvl if tp else Hv) * dv), ParamSpec((spec.out,), shard_dim=1 if tp else None))

    x_in = emit_all_gather(g, "ln1_ag", x, "ln1_out_ag", dim=1, **kw) if tp else x         # tp: [b, s, h]
    # [b, S, h] -> grouped: qkvz [b, S, proj*P], ba [b, S, proj*2r]; flat: [b, S, proj*(P+2r)]
    projected = tuple(emit_gemm(g, f"{name}_proj", x_in, w, name, **kw)
                      for name, w in zip(("qkvz", "ba") if len(w_proj) == 2 else ("qkvzba",), w_proj))
    return _core_and_out(g, spec, projected, (w_conv, a_log, dt_bias, w_norm), w_out, kw)


def _core_and_out(g: GraphBuilder, spec: LinearAttentionSpec, projected: tuple, weights: tuple, w_out: str,
                  kw: dict) -> str:
    """The projections [b, S, proj*X] (S: s under tp, s/n under sp) through the Ulysses all-to-all (sp),
    the GATED_DELTA core (its weights: conv, A_log, dt_bias, norm) and the output projection -> [b, s/n, h]."""
    st = g.strategy
    n, tp = st.n, st.attn == "tp"
    Hk, Hv, dk, dv, K = spec.k_heads, spec.v_heads, spec.k_dim, spec.v_dim, spec.conv_size
    Hkl, Hvl = Hk // n, Hv // n
    b, s = g.dims.b, g.dims.s
    if not tp and n > 1:
        # Ulysses: split the key-head groups, gather the sequence. [b, s/n, Hk*X] -> [b, s, Hkl*X]
        outs = tuple(g.value(f"{v}_a2a", (b, s, g.shape(v)[2] // n)) for v in projected)
        g.collective("qkvz_a2a", OpKind.ALL_TO_ALL, projected, outs, full_bytes=g.nbytes(*projected),
                     attrs={"mode": "heads", "split_dim": 2, "cat_dim": 1}, **kw)
        projected = outs
    core = g.value("delta_out", (b, s, Hvl * dv))                                           # [b, s, Hvl*dv]
    sizes = dict(b=b, s=s, v_heads=Hvl, k_dim=dk, v_dim=dv)
    ins = (*projected, *weights)
    per_feature = spec.layout == "kda"
    g.node("gated_delta", OpKind.GATED_DELTA, ins, (core,),
           flops=gated_delta_flops(k_heads=Hkl, conv=K, chunk=spec.chunk_size, per_feature=per_feature, **sizes),
           mem_bytes=g.nbytes(*ins) + g.nbytes(core) + gated_delta_state_bytes(chunk=spec.chunk_size, **sizes),
           attrs=attention_attrs(seq=s, head_dim=dk) | {
               "k_heads": Hkl, "v_heads": Hvl, "k_dim": dk, "v_dim": dv, "conv": K, "eps": spec.eps,
               "chunk_size": spec.chunk_size} | ({"layout": spec.layout} if spec.layout != "grouped" else {}), **kw)
    if not tp and n > 1:
        # Ulysses back: split the sequence, gather the heads. [b, s, Hvl*dv] -> [b, s/n, Hv*dv]
        back = g.value("delta_out_a2a", (b, s // n, Hv * dv))
        g.collective("delta_out_a2a", OpKind.ALL_TO_ALL, (core,), (back,), full_bytes=g.nbytes(core),
                     attrs={"mode": "heads", "split_dim": 1, "cat_dim": 2}, **kw)
        core = back
    if not tp or n == 1:
        return emit_gemm(g, "out_proj", core, w_out, "attn_out", **kw)                     # [b, s/n, h]
    partial = emit_gemm(g, "out_proj", core, w_out, "attn_out_partial", **kw)             # [b, s, h] partial
    return emit_reduce_scatter(g, "attn_rs", partial, "attn_out", dim=1, **kw)             # -> [b, s/n, h]


def _flat_projection(g: GraphBuilder, pieces: tuple, Hk: int, width: int) -> str:
    """Projections of separate weights as one weight whose rows are, for each rank's share of the heads,
    its rows of each piece ((tensor, first row, rows) over every head, in the kernel's order: Qwen3.5-MoE's
    q, k, v (in_proj_qkv's), z [Hv dv], b [Hv], a [Hv]; Kimi's q_proj, k_proj, v_proj, b_proj): under tp
    this rank's share ([Hkl*width, h], each piece cut by n); under sp every rank's, rank-major and
    replicated ([Hk*width, h]), so that the Ulysses all-to-all's n slices of the features are each rank's
    heads (at n = 1 both are the pieces' rows one after another)."""
    n, tp, h = g.strategy.n, g.strategy.attn == "tp", g.dims.h
    if tp or n == 1:
        sources = tuple(ParamSource(name, narrow=(0, start, rows)) for name, start, rows in pieces)
        return g.param("in_proj.weight", ((Hk // n if tp else Hk) * width, h),
                       ParamSpec(sources, shard_dim=0 if tp else None))
    by_rank = tuple(ParamSource(name, narrow=(0, start + r * (rows // n), rows // n))
                    for r in range(n) for name, start, rows in pieces)
    return g.param("in_proj.weight", (Hk * width, h), ParamSpec(by_rank, shard_dim=None))


def _emit_kda(g: GraphBuilder, spec: LinearAttentionSpec, x: str, conv: tuple, kw: dict) -> str:
    """Kimi Delta Attention (layout 'kda'; H = Hk = Hv heads of d = dk = dv, R the gates' rank):
    q_proj, k_proj, v_proj and b_proj as one weight of 3d + 1 rows per head (``_flat_projection``); the
    low-rank forget and output gates f_a [R, h], g_a [R, h] replicated (under tp their gradients are
    partial per rank and all-reduced, as MLA's down projections), f_b [H dk, R], g_b [H dv, R] cut by
    heads under tp; the Ulysses all-to-all (sp) moves the three projections' heads alike. ``conv``: the
    conv weight's q, k and v row ranges (``emit_linear_attention``'s)."""
    n, tp, h = g.strategy.n, g.strategy.attn == "tp", g.dims.h
    H, d, K, R = spec.v_heads, spec.k_dim, spec.conv_size, spec.gate_rank
    Hl = H // n
    proj = Hl if tp else H
    pieces = ((spec.qkvz.qualname, 0, H * d), (spec.k.qualname, 0, H * d), (spec.v.qualname, 0, H * d),
              (spec.b.qualname, 0, H))
    w_qkvb = _flat_projection(g, pieces, H, 3 * d + 1)                                      # [proj*(3d+1), h]
    rep = lambda name, shape, src: g.param(name, shape, ParamSpec((src,), shard_dim=None))  # noqa: E731
    w_fa, w_ga = rep("f_a_proj.weight", (R, h), spec.a_down), rep("g_a_proj.weight", (R, h), spec.z_down)
    w_fb = g.param("f_b_proj.weight", (proj * d, R), ParamSpec((spec.a,), shard_dim=0 if tp else None))
    w_gb = g.param("g_b_proj.weight", (proj * d, R), ParamSpec((spec.z,), shard_dim=0 if tp else None))
    w_conv = g.param("conv1d.weight", (3 * Hl * d, 1, K), ParamSpec(conv, shard_dim=0))
    a_log = g.param("A_log", (1, 1, Hl, 1), ParamSpec((spec.a_log,), shard_dim=2))
    dt_bias = g.param("dt_bias", (Hl * d,), ParamSpec((spec.dt_bias,), shard_dim=0))
    w_norm = g.param("o_norm.weight", (d,), ParamSpec((spec.norm,), shard_dim=None))
    w_out = g.param("o_proj.weight", (h, (Hl if tp else H) * d), ParamSpec((spec.out,), shard_dim=1 if tp else None))

    x_in = emit_all_gather(g, "ln1_ag", x, "ln1_out_ag", dim=1, **kw) if tp else x         # tp: [b, s, h]
    qkvb = emit_gemm(g, "qkvb_proj", x_in, w_qkvb, "qkvb", **kw)                           # [b, S, proj*(3d+1)]
    f = emit_gemm(g, "f_b_proj", emit_gemm(g, "f_a_proj", x_in, w_fa, "f_latent", **kw), w_fb, "f", **kw)
    z = emit_gemm(g, "g_b_proj", emit_gemm(g, "g_a_proj", x_in, w_ga, "z_latent", **kw), w_gb, "z", **kw)
    return _core_and_out(g, spec, (qkvb, f, z), (w_conv, a_log, dt_bias, w_norm), w_out, kw)  # [b, s/n, h]
