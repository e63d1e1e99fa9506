"""Rules for the project's own reference layer, moegraph.models.MoETransformerLayer."""

from __future__ import annotations

from moegraph import models
from moegraph.ir import ParamSource
from moegraph.lowering import register
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec


@register(models.RMSNorm)
def rmsnorm(module: models.RMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.eps)


@register(models.Attention)
def attention(module: models.Attention, qualname: str) -> AttentionSpec:
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"), heads=module.heads,
                         kv_heads=module.kv_heads, head_dim=module.head_dim, rope_theta=module.rope_theta)


@register(models.MoE)
def moe(module: models.MoE, qualname: str) -> MoESpec:
    experts, ffn_hidden, _ = module.w1.shape
    return MoESpec(router=ParamSource(f"{qualname}.router.weight"), w1=ParamSource(f"{qualname}.w1"),
                   w3=ParamSource(f"{qualname}.w3"), w2=ParamSource(f"{qualname}.w2"),
                   experts=experts, top_k=module.top_k, ffn_hidden=ffn_hidden, hidden=module.w1.shape[2])
