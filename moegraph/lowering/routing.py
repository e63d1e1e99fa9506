"""The MoE block's router and, under ag-rs dispatch, the gather of its result.

Notation (as ``blocks``): b micro-batch, s sequence, h hidden, n group size, k top-k, E experts,
L local tokens of a chunk (s/n unchunked), T = b*L tokens routed on this rank.

Under every dispatch the ROUTER reads this rank's own tokens [b, L, h] and writes [b, L, k] top-k
weights (fp32) and expert ids (int64). Under ag-rs (n > 1) both are all-gathered along L in one
collective, as the tokens are ([b, nL, k]: the tokens' own order, also for b > 1), before the token
all-gather (``blocks._emit_moe_chunk``): the index map is then known before the tokens arrive,
which MegaScale-MoE's AG+scatter+GroupedGEMM kernel needs (§4.2; ``passes/fuse.py``), and the
router's FLOPs and its aux-loss statistics cover this rank's tokens as under a2a
(``passes/edges.py``). ROUTER is row-wise by definition (each row's top-k from its own logits; a
router that reads other tokens has no lowering: the structural rules refuse it), so routing the
local tokens and gathering the result is the function routing the gathered tokens was.
"""

from __future__ import annotations

from moegraph.builder import ConfigError, GraphBuilder
from moegraph.ir import OpKind, ValueKind
from moegraph.lowering.blocks_ext import WEIGHT_DTYPE, emit_rmsnorm, emit_scale
from moegraph.lowering.specs import MoESpec

INDEX_DTYPE = "int64"


def router_attrs(spec: MoESpec) -> dict:
    """The ROUTER node's attributes: ``scoring`` always (the kernel reads no default); the other
    fields only where they differ from Mixtral's softmax router."""
    attrs = {"top_k": spec.top_k, "experts": spec.experts, "scoring": spec.scoring} \
        | ({} if spec.normalize else {"normalize": False})
    if not spec.plain_router:         # family_kernels.route_general: every field explicit
        return attrs | {"general": True, "groups": spec.groups, "topk_groups": spec.topk_groups, "scale": spec.scale,
                        "group_score": spec.group_score, "score_bias": spec.score_bias is not None,
                        "logit_bias": spec.router_bias is not None, "normalize": spec.normalize} \
            | ({"bias_on_logits": True} if spec.bias_on_logits else {}) \
            | ({"topk_first": True} if spec.topk_first else {}) \
            | ({"expert_scale": True} if spec.expert_scale is not None else {})
    if spec.scoring == "sigmoid":
        attrs |= {"groups": spec.groups, "topk_groups": spec.topk_groups, "scale": spec.scale,
                  "score_bias": spec.score_bias is not None}
    elif spec.score_bias is not None or spec.groups != 1 or spec.scale != 1.0:
        raise ConfigError(f"router {spec.router.qualname}: a score bias, expert groups and scaling are modelled for "
                          "sigmoid scoring only")
    return attrs


def route_local_tokens(g: GraphBuilder, spec: MoESpec, x: str, router_ins: tuple[str, ...], c: str,
                       kw: dict) -> tuple[str, str]:
    """The ROUTER on this rank's own tokens (every dispatch): [b, L, h] -> top-k weights and expert
    ids [b, L, k] each; 2*T*h*E FLOPs for the logits, 5*T*E for the scores and the top-k."""
    b, L, h = g.shape(x)
    E, k, T = spec.experts, spec.top_k, b * L
    topk_w = g.value(f"topk_weights{c}", (b, L, k), kind=ValueKind.ROUTING, dtype=WEIGHT_DTYPE)
    topk_idx = g.value(f"topk_experts{c}", (b, L, k), kind=ValueKind.ROUTING, dtype=INDEX_DTYPE)
    g.node(f"router{c}", OpKind.ROUTER, (x, *router_ins), (topk_w, topk_idx),
           flops=2 * T * h * E + 5 * T * E + (T * k if spec.expert_scale is not None else 0), attrs=router_attrs(spec),
           **kw)
    return topk_w, topk_idx


def router_input(g: GraphBuilder, spec: MoESpec, x: str, kw: dict) -> str:
    """The router's input: the block input x [b, s/n, h], or (Gemma 4) its own RMSNorm of x, whose
    weight is the router's learned scale, times a constant (h^-0.5)."""
    if spec.router_norm is None:
        return x
    y = emit_rmsnorm(g, spec.router_norm, x, name="router_norm", out="router_normed", **kw)
    if spec.router_input_scale == 1.0:
        return y
    return emit_scale(g, y, spec.router_input_scale, name="router_in_scale", out="router_in", **kw)


def gather_routing(g: GraphBuilder, topk_w: str, topk_idx: str, c: str, kw: dict) -> tuple[str, str]:
    """Every rank's top-k weights and expert ids, in one all-gather along the sequence like the
    tokens': [b, L, k] x 2 -> [b, nL, k] x 2 (b*L*k*(4 + 8) bytes per rank). One collective, so the
    weights are in hand wherever the ids are (the combine of a fused GroupedGEMM+gather+RS needs
    them when its kernel starts). The weights' gradient comes back by the gather's reduce-scatter."""
    if g.strategy.n == 1:
        return topk_w, topk_idx
    outs = []
    for v, name in ((topk_w, f"topk_weights_ag{c}"), (topk_idx, f"topk_experts_ag{c}")):
        b, L, k = g.shape(v)
        outs.append(g.value(name, (b, L * g.strategy.n, k), kind=ValueKind.ROUTING, dtype=g.values[v].dtype))
    g.collective(f"routing_ag{c}", OpKind.ALL_GATHER, (topk_w, topk_idx), tuple(outs), full_bytes=g.nbytes(*outs),
                 attrs={"dim": 1}, **kw)
    return outs[0], outs[1]
