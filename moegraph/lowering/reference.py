"""Rules for the project's own reference layer, moegraph.models.MoETransformerLayer."""

from __future__ import annotations

from moegraph import models
from moegraph.edges import AuxLoss, EdgeHead
from moegraph.ir import ParamSource
from torch import nn

from moegraph.lowering import (LoweringError, ModelOutput, ModelSpec, check_embedding, check_head, register,
                               register_model)
from moegraph.lowering.blocks import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec


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


@register(models.MLA)
def mla(module: models.MLA, qualname: str) -> MLASpec:
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    low_rank = module.q_rank is not None
    return MLASpec(q=None if low_rank else p("q_proj"), q_a=p("q_a_proj") if low_rank else None,
                   q_norm=rmsnorm(module.q_a_norm, f"{qualname}.q_a_norm") if low_rank else None,
                   q_b=p("q_b_proj") if low_rank else None, kv_a=p("kv_a_proj"),
                   kv_norm=rmsnorm(module.kv_a_norm, f"{qualname}.kv_a_norm"), kv_b=p("kv_b_proj"), o=p("o_proj"),
                   heads=module.heads, nope_dim=module.nope_dim, rope_dim=module.rope_dim, v_dim=module.v_dim,
                   q_rank=module.q_rank, kv_rank=module.kv_rank, rope_theta=module.rope_theta,
                   rope_interleave=False, tuple_output=False)


@register(models.DenseMLP)
def dense_mlp(module: models.DenseMLP, qualname: str) -> MLPSpec:
    q = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return MLPSpec(w1=q("w1"), w3=q("w3"), w2=q("w2"), ffn_hidden=module.w1.out_features,
                   hidden=module.w1.in_features)


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
                   normalize=module.normalize, shared=shared, scoring=module.scoring,
                   score_bias=None if module.e_score_correction_bias is None
                   else ParamSource(f"{qualname}.e_score_correction_bias"),
                   groups=module.groups, topk_groups=module.topk_groups, scale=module.scale)


@register_model(models.MoETransformer, children={"embed": nn.Embedding, "layers": nn.ModuleList,
                                                 "norm": models.RMSNorm, "lm_head": nn.Linear})
def transformer(model: models.MoETransformer) -> ModelSpec:
    check_embedding(model.embed, "embed")
    tied = check_head(model, model.lm_head, model.embed, "lm_head")
    aux = None
    if model.router_aux_loss_coef > 0:          # the routers' load-balancing loss (moegraph.models)
        moe = next(layer.moe for layer in model.layers if layer.moe is not None)
        aux = AuxLoss(model.router_aux_loss_coef, moe.w1.shape[0], moe.top_k)
    norm = rmsnorm(model.norm, "norm")
    return ModelSpec(embed="embed.weight", padding_idx=model.embed.padding_idx, layers="layers",
                     norm=norm.weight.qualname, head="lm_head.weight", output=ModelOutput.CAUSAL_LM,
                     edge_head=EdgeHead("rms", norm.eps), tied=tied, aux_loss=aux)
