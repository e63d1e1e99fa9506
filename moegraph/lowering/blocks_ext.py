"""Emitters for the parts structural lowering added to the blocks of ``blocks``: LayerNorms, per-head
and L2 q/k norms (and q/k/latent norms over a projection's width, sharded under tp), biases after a
projection, gated activations other than SwiGLU, a gated attention output, expert biases, constant
scales. Each is called from ``blocks`` only where a spec asks for it, so a spec without
these parts lowers to the graph it always did.

Notation (as ``blocks``): b micro-batch, s sequence, h hidden, n group size, S rows on this rank
after the block's layout, H/G query/kv heads, d head dim, R expert rows, El local experts, Fl local
expert h_ffn (f under ep, f/n under tp).
"""

from __future__ import annotations

import math

from moegraph.builder import GraphBuilder
from moegraph.ir import OpKind, ParamSource, ParamSpec
from moegraph.lowering.specs import Activation, AttentionSpec, NormSpec, OutGateSpec

WEIGHT_DTYPE = "fp32"


def _numel(g: GraphBuilder, v: str) -> int:
    return math.prod(g.shape(v))


def emit_rmsnorm(g: GraphBuilder, spec: NormSpec, x: str, *, name: str, out: str, module: str, block: str) -> str:
    """[b, s/n, h] -> [b, s/n, h]; the weight is replicated (its gradient is all-reduced). A LayerNorm
    spec (kind 'layer') lowers to NORM (+ BIAS)."""
    if spec.kind == "layer":
        return emit_layernorm(g, spec, x, name=name, out=out, module=module, block=block)
    h = g.shape(x)[-1]
    w = g.param(f"{name}.weight", (h,), ParamSpec((spec.weight,), shard_dim=None))
    y = g.like(out, x)
    g.node(name, OpKind.RMSNORM, (x, w), (y,), flops=4 * _numel(g, x), attrs=spec.attrs, module=module, block=block)
    return y


def emit_layernorm(g: GraphBuilder, spec: NormSpec, x: str, *, name: str, out: str, module: str, block: str) -> str:
    """LayerNorm of [.., h] rows with a replicated weight [h], then its bias (a BIAS node) when it has
    one; every rank normalises its own rows, so the weights' gradients are partial and all-reduced."""
    h = g.shape(x)[-1]
    w = g.param(f"{name}.weight", (h,), ParamSpec((spec.weight,), shard_dim=None))
    y = g.like(out if spec.bias is None else f"{out}_unbiased", x)
    g.node(name, OpKind.NORM, (x, w), (y,), flops=7 * _numel(g, x), attrs={"kind": "layer", "eps": spec.eps},
           module=module, block=block)
    if spec.bias is None:
        return y
    return emit_bias(g, y, spec.bias, name=f"{name}_bias", out=out, module=module, block=block)


def emit_bias(g: GraphBuilder, x: str, src: ParamSource, *, name: str, out: str, module: str, block: str) -> str:
    """x + b for a replicated b [X] over this rank's rows [.., X] (its gradient: dy summed over the
    rows, partial per rank, all-reduced)."""
    b = g.param(f"{name}.b", (g.shape(x)[-1],), ParamSpec((src,), shard_dim=None))
    y = g.like(out, x)
    g.node(name, OpKind.BIAS, (x, b), (y,), flops=_numel(g, x), module=module, block=block)
    return y


def emit_head_norm(g: GraphBuilder, spec: NormSpec | None, x: str, *, name: str, head_dim: int, kw: dict,
                   l2_eps: float | None = None, w: str | None = None) -> str:
    """RMSNorm of each head's d features of [b, S, X*d] with one weight [d] shared by the heads
    (Qwen3's q/k norm; ``w``: that weight's value when token chunks share it), or with ``spec`` None
    a weightless L2 norm of eps ``l2_eps`` (Llama 4's). Each rank holds whole heads (tp cuts by
    heads), so no cross-rank reduction is needed."""
    y = g.like(f"{name}_out", x)
    if spec is None:
        g.node(name, OpKind.NORM, (x,), (y,), flops=3 * _numel(g, x),
               attrs={"kind": "l2", "eps": l2_eps, "group": head_dim}, **kw)
        return y
    w = w or g.param(f"{name}.weight", (head_dim,), ParamSpec((spec.weight,), shard_dim=None))
    g.node(name, OpKind.NORM, (x, w), (y,), flops=4 * _numel(g, x),
           attrs={"kind": "head_rms", "group": head_dim} | spec.attrs, **kw)
    return y


def emit_glu(g: GraphBuilder, name: str, a: str, b: str, out: str, act: Activation, kw: dict,
             limit: float | None = None, alpha: float | None = None, row_weights: str | None = None) -> str:
    """act(a) * b: SWIGLU for silu (as always), GLU otherwise: [.., F] x 2 -> [.., F].

    ``row_weights`` ([R], rows [R, F]): each output row also times its routing weight, in the same
    kernel (MegaScale-MoE §4.1 multiplies SwiGLU's output by the gating weight; §7 moves it back
    after FC2 only for FP8): one pass over the rows where a separate GATE kernel would re-read and
    re-write them, forward and backward."""
    y = g.like(out, a)
    ins, weighted = ((a, b, row_weights), {"row_weights": True}) if row_weights is not None else ((a, b), {})
    scale = _numel(g, a) if row_weights is not None else 0
    if act == "silu":
        g.node(name, OpKind.SWIGLU, ins, (y,), flops=5 * _numel(g, a) + scale, attrs=weighted, **kw)
        return y
    attrs = {"act": act} | ({"limit": limit, "alpha": alpha} if act == "clamped_swiglu" else {}) | weighted
    g.node(name, OpKind.GLU, ins, (y,), flops=(8 if act == "clamped_swiglu" else 10) * _numel(g, a) + scale,
           attrs=attrs, **kw)
    return y


def emit_scale(g: GraphBuilder, x: str, factor: float, *, name: str, out: str, module: str, block: str) -> str:
    """x * factor (a constant): [..] -> [..]."""
    y = g.like(out, x)
    g.node(name, OpKind.SCALE, (x,), (y,), flops=_numel(g, x), attrs={"factor": float(factor)},
           module=module, block=block)
    return y


def emit_scale_by(g: GraphBuilder, x: str, src: ParamSource, *, name: str, out: str, module: str, block: str) -> str:
    """x * s for a [1] buffer s of the layer (Gemma 4's layer_scalar; read, never trained): [..] -> [..]."""
    s = g.param(f"{name}.factor", (1,), ParamSpec((src,), shard_dim=None, buffer=True))
    y = g.like(out, x)
    g.node(name, OpKind.SCALE, (x, s), (y,), flops=_numel(g, x), attrs={"factor": 1.0, "by_input": True},
           module=module, block=block)
    return y


def emit_limit(g: GraphBuilder, x: str, how: str, c: float, *, name: str, out: str, module: str, block: str) -> str:
    """x bounded by c (LIMIT: clamp to [-c, c], or the soft cap c*tanh(x/c)): [..] -> [..]."""
    y = g.like(out, x)
    g.node(name, OpKind.LIMIT, (x,), (y,), flops=(1 if how == "clamp" else 3) * _numel(g, x),
           attrs={"how": how, "limit": float(c)}, module=module, block=block)
    return y


def expert_bias_params(g: GraphBuilder, sources: tuple[ParamSource, ParamSource, ParamSource], El: int, Fl: int,
                       ep: bool) -> tuple[str, str, str]:
    """The experts' biases [El, Fl] (gate, up) and [El, h] (down), cut like their weights: by expert
    under ep; under tp the gate/up biases by h_ffn and the down bias replicated (every rank adds
    b2/n to its partial sums, which the combine's reduce-scatter adds up: attr share=n)."""
    h = g.dims.h
    b1 = g.param("b1", (El, Fl), ParamSpec((sources[0],), shard_dim=0 if ep else 1))
    b3 = g.param("b3", (El, Fl), ParamSpec((sources[1],), shard_dim=0 if ep else 1))
    b2 = g.param("b2", (El, h), ParamSpec((sources[2],), shard_dim=0 if ep else None))
    return b1, b3, b2


def emit_grouped_bias(g: GraphBuilder, name: str, rows: str, bias: str, seg: str, *, share: int = 1,
                      row_weights: str | None = None, kw: dict) -> str:
    """rows [R, N] + bias[expert of row] / share (times the row's routing weight when given: the gate
    moved before FC2 must scale FC2's bias too)."""
    y = g.like(f"{rows}_biased", rows)
    ins = (rows, bias, seg) + ((row_weights,) if row_weights is not None else ())
    g.node(name, OpKind.GROUPED_BIAS, ins, (y,), flops=_numel(g, rows),
           attrs={"share": share} if share != 1 else {}, **kw)
    return y


def mask_attrs(spec) -> dict:
    """ATTENTION attrs beyond plain causal GQA: window, chunk, softmax scale, sinks (family_kernels.attend)."""
    if spec is None:
        return {}
    found = {"window": getattr(spec, "window", None), "chunk_size": getattr(spec, "chunk", None),
             "scale": spec.scale}
    return {k: v for k, v in found.items() if v is not None} | ({"sinks": True} if getattr(spec, "sinks", None) else {})


def head_norms(g: GraphBuilder, spec: AttentionSpec, q: str, k: str, c: str, kw: dict,
               weights: tuple[str | None, str | None]) -> tuple[str, str]:
    """Per-head q and k norms (weights [d], or weightless L2): [b, S, X*d] -> [b, S, X*d] each. Their
    weights are created once for every token chunk (``weights``), so the chunks' gradients sum."""
    d = spec.head_dim
    return (emit_head_norm(g, spec.q_norm, q, name=f"q_norm{c}", head_dim=d, kw=kw, l2_eps=spec.qk_l2_eps,
                           w=weights[0]),
            emit_head_norm(g, spec.k_norm, k, name=f"k_norm{c}", head_dim=d, kw=kw, l2_eps=spec.qk_l2_eps,
                           w=weights[1]))


def emit_width_norm(g: GraphBuilder, spec: NormSpec, x: str, name: str, w: str, width: int, kw: dict) -> str:
    """RMSNorm over the last dim of x, whose full row is ``width`` wide: [b, S, X] -> [b, S, X].

    When this rank holds the whole row (sp, n = 1) it is a plain RMSNORM. Under attention tp it
    holds width/n of each row, so the mean of squares needs every rank's part: a SQUARE_SUM
    [b, S, 1] (fp32), an ALL_REDUCE of it (b*S*4 bytes per rank, 2(n-1)/n on the wire), then
    RMSNORM_SHARDED scales the slice.
    """
    y = g.like(f"{name}_out", x)
    if g.shape(x)[-1] == width:
        g.node(name, OpKind.RMSNORM, (x, w), (y,), flops=4 * _numel(g, x), attrs=spec.attrs, **kw)
        return y
    rows = g.shape(x)[:-1]
    part = g.value(f"{name}_sumsq_part", (*rows, 1), dtype=WEIGHT_DTYPE)
    g.node(f"{name}_sumsq", OpKind.SQUARE_SUM, (x,), (part,), flops=2 * _numel(g, x), **kw)
    total = g.value(f"{name}_sumsq", (*rows, 1), dtype=WEIGHT_DTYPE)
    g.collective(f"{name}_allreduce", OpKind.ALL_REDUCE, (part,), (total,),
                 full_bytes=g.nbytes(part), flops=_numel(g, part), **kw)
    g.node(name, OpKind.RMSNORM_SHARDED, (x, w, total), (y,), flops=3 * _numel(g, x),
           attrs={"width": width} | spec.attrs, **kw)
    return y


def out_gate_param(g: GraphBuilder, gate: OutGateSpec, heads: int, dv: int) -> str:
    """g_proj's weight for this rank's ``heads`` query heads: [heads, h] (one gate per head) or
    [heads*dv, h], cut by heads under attention tp like q's rows, replicated under sp."""
    rows = heads if gate.per_head else heads * dv
    return g.param("g_proj.weight", (rows, g.dims.h),
                   ParamSpec((gate.weight,), shard_dim=0 if g.strategy.attn == "tp" else None))


def emit_out_gate(g: GraphBuilder, gate: OutGateSpec, logit: str, y: str, dv: int, *, name: str, out: str,
                  kw: dict) -> str:
    """y * act(logit), a GLU node: [b, S, X*dv] x [b, S, X] (per head, broadcast over dv) or
    [b, S, X*dv] -> [b, S, X*dv]. Sigmoid and softplus: ~4 FLOPs a gate, one multiply per feature."""
    gated = g.like(out, y)
    g.node(name, OpKind.GLU, (logit, y), (gated,), flops=_numel(g, y) + 4 * _numel(g, logit),
           attrs={"act": gate.act} | ({"group": dv} if gate.per_head else {}), **kw)
    return gated


def position_attrs(g: GraphBuilder) -> dict:
    """Where the rows a RoPE kernel sees sit in the sequence (kernels.chunk_positions): tp gathers
    the whole sequence, sp keeps this rank's shard; chunked, each chunk says which it is."""
    return {"positions": "full" if g.strategy.attn == "tp" else "shard"} | (
        {"chunks": g.strategy.chunks} if g.strategy.chunks > 1 else {})


def ulysses_in(g: GraphBuilder, q: str, k: str, v: str, c: str, kw: dict) -> tuple[str, str, str]:
    """Under attn='sp' (Ulysses) split heads, gather sequence: [b, L, X*d] -> [b, nL, X/n*d] for each
    of q, k, v; under 'tp' (heads already split) or n = 1 nothing moves."""
    n = g.strategy.n
    if g.strategy.attn == "tp" or n == 1:
        return q, k, v
    outs = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        b, S, X = g.shape(t)
        outs.append(g.value(f"{name}_a2a{c}", (b, S * n, X // n)))
    g.collective(f"qkv_a2a{c}", OpKind.ALL_TO_ALL, (q, k, v), tuple(outs), full_bytes=g.nbytes(q, k, v),
                 attrs={"mode": "heads", "split_dim": 2, "cat_dim": 1}, **kw)
    return tuple(outs)


def split_heads(g: GraphBuilder, x: str, sizes: tuple[int, ...], outs: tuple[str, ...], *, name: str,
                kw: dict) -> tuple[str, ...]:
    """Each head's features of x [b, S, X*sum(sizes)] cut by ``sizes`` into copies [b, S, X*size_i]
    (a SPLIT of mode 'heads': Qwen3-Next's q_proj rows are each head's query, then its gate)."""
    *lead, width = g.shape(x)
    X = width // sum(sizes)
    values = tuple(g.value(o, (*lead, X * k)) for o, k in zip(outs, sizes))
    g.node(name, OpKind.SPLIT, (x,), values, attrs={"dim": len(lead), "sizes": tuple(sizes), "mode": "heads"}, **kw)
    return values
