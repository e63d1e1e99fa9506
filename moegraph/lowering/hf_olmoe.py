"""Rules for Hugging Face transformers' OLMoE (OlmoeDecoderLayer and its parts).

Beyond Mixtral: q and k are RMS-normalised over their whole projection width (H*d and G*d)
before RoPE (AttentionSpec.q_norm / k_norm); under attention tp a rank holds only its heads'
part of that width, so the blocks add a cross-rank reduction of the sums of squares (an
ALL_REDUCE of [b, s, 1]). The router does not renormalise its top-k weights by default.
"""

from __future__ import annotations

from torch import nn
from transformers.models.olmoe import modeling_olmoe as hf

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec
from moegraph.lowering.hf_mixtral import check_attention

_CHILDREN = {name: nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
    "q_norm": hf.OlmoeRMSNorm, "k_norm": hf.OlmoeRMSNorm}


@register(hf.OlmoeRMSNorm)
def rmsnorm(module: hf.OlmoeRMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.variance_epsilon)


@register(hf.OlmoeAttention, children=_CHILDREN)
def attention(module: hf.OlmoeAttention, qualname: str) -> AttentionSpec:
    check_attention(module, qualname)
    cfg = module.config
    if cfg.clip_qkv is not None:
        raise LoweringError(f"{qualname}: config.clip_qkv={cfg.clip_qkv} (clamping q, k, v) is not supported; "
                            "set it to None")
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
    for name, width in (("q_norm", heads * d), ("k_norm", kv_heads * d)):
        if getattr(module, name).weight.shape[0] != width:
            raise LoweringError(f"{qualname}.{name} normalises {getattr(module, name).weight.shape[0]} features, "
                                f"not the projection's {width}")
    p = lambda name, what="weight": ParamSource(f"{qualname}.{name}.{what}")  # noqa: E731
    norm = lambda name: NormSpec(p(name), getattr(module, name).variance_epsilon)  # noqa: E731
    biased = module.q_proj.bias is not None and module.k_proj.bias is not None and module.v_proj.bias is not None
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"), heads=heads, kv_heads=kv_heads,
                         head_dim=d, rope_theta=float(cfg.rope_parameters["rope_theta"]), tuple_output=True,
                         qkv_bias=(p("q_proj", "bias"), p("k_proj", "bias"), p("v_proj", "bias")) if biased else None,
                         q_norm=norm("q_norm"), k_norm=norm("k_norm"))


@register(hf.OlmoeSparseMoeBlock, children={"gate": hf.OlmoeTopKRouter, "experts": hf.OlmoeExperts})
def sparse_moe(module: hf.OlmoeSparseMoeBlock, qualname: str) -> MoESpec:
    experts = module.experts
    if experts.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        raise LoweringError(f"{qualname}.experts: activation {experts.act_fn!r} is not SiLU (SwiGLU)")
    f = experts.intermediate_dim
    gate_up = f"{qualname}.experts.gate_up_proj"
    return MoESpec(router=ParamSource(f"{qualname}.gate.weight"),
                   w1=ParamSource(gate_up, narrow=(1, 0, f)), w3=ParamSource(gate_up, narrow=(1, f, f)),
                   w2=ParamSource(f"{qualname}.experts.down_proj"), experts=experts.num_experts,
                   top_k=module.gate.top_k, ffn_hidden=f, hidden=experts.hidden_dim,
                   normalize=bool(module.gate.norm_topk_prob))
