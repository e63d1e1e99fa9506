"""Rules for the project's own reference layer, moegraph.models.MoETransformerLayer."""

from __future__ import annotations

from moegraph import models
from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import AttentionSpec, MLPSpec, MoESpec, NormSpec


@register(models.RMSNorm)
def rmsnorm(module: models.RMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.eps)


@register(models.Attention)
def attention(module: models.Attention, qualname: str) -> AttentionSpec:
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    bias = None
    if module.q_proj.bias is not None:      # the constructor gives all three a bias or none
        bias = tuple(ParamSource(f"{qualname}.{name}.bias") for name in ("q_proj", "k_proj", "v_proj"))
    q_norm = k_norm = None
    if module.q_norm is not None:           # both or neither, over the full widths H*d and G*d
        q_norm, k_norm = rmsnorm(module.q_norm, f"{qualname}.q_norm"), rmsnorm(module.k_norm, f"{qualname}.k_norm")
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"), heads=module.heads,
                         kv_heads=module.kv_heads, head_dim=module.head_dim, rope_theta=module.rope_theta,
                         qkv_bias=bias, q_norm=q_norm, k_norm=k_norm)


@register(models.MoE)
def moe(module: models.MoE, qualname: str) -> MoESpec:
    experts, ffn_hidden, _ = module.w1.shape
    shared = None
    if module.shared is not None:
        if type(module.shared) is not models.SharedExpert:    # its forward is what the spec stands for
            raise LoweringError(f"{qualname}.shared ({type(module.shared).__name__}) is not a SharedExpert; "
                                f"register a rule for {type(module).__name__} that describes it")
        q = lambda name: ParamSource(f"{qualname}.shared.{name}.weight")  # noqa: E731
        shared = MLPSpec(w1=q("w1"), w3=q("w3"), w2=q("w2"), ffn_hidden=module.shared.w1.out_features,
                         hidden=module.shared.w1.in_features,
                         gate=None if module.shared.gate is None else q("gate"))
    return MoESpec(router=ParamSource(f"{qualname}.router.weight"), w1=ParamSource(f"{qualname}.w1"),
                   w3=ParamSource(f"{qualname}.w3"), w2=ParamSource(f"{qualname}.w2"),
                   experts=experts, top_k=module.top_k, ffn_hidden=ffn_hidden, hidden=module.w1.shape[2],
                   normalize=module.normalize, shared=shared)
