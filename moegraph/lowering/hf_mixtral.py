"""Rules for Hugging Face transformers' Mixtral (MixtralDecoderLayer and its parts).

Plain torch.fx cannot trace MixtralSparseMoeBlock (its expert loop depends on the routing),
so the tracer keeps these modules as leaves and these rules describe them. The fused
``gate_up_proj`` [E, 2*h_ffn, h] is read as two narrowed halves: gate (w1) then up (w3).
"""

from __future__ import annotations

from transformers.models.mixtral import modeling_mixtral as hf

from moegraph.ir import ParamSource
from moegraph.lowering import register
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec


@register(hf.MixtralRMSNorm)
def rmsnorm(module: hf.MixtralRMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.variance_epsilon)


@register(hf.MixtralAttention)
def attention(module: hf.MixtralAttention, qualname: str) -> AttentionSpec:
    cfg = module.config
    if getattr(cfg, "sliding_window", None):
        raise NotImplementedError(f"{qualname} ({type(module).__name__}): sliding_window attention is not supported")
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"{qualname} ({type(module).__name__}): rope_type {rope['rope_type']!r} is not supported")
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"),
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=module.head_dim, rope_theta=float(rope["rope_theta"]), tuple_output=True)


@register(hf.MixtralSparseMoeBlock)
def sparse_moe(module: hf.MixtralSparseMoeBlock, qualname: str) -> MoESpec:
    experts = module.experts
    if module.jitter_noise:
        raise NotImplementedError(f"{qualname} ({type(module).__name__}): router_jitter_noise={module.jitter_noise} "
                                  "is random per step and cannot be reproduced; set it to 0")
    if experts.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        raise NotImplementedError(f"{qualname}.experts: activation {experts.act_fn!r} is not SiLU (SwiGLU)")
    f = experts.intermediate_dim
    gate_up = f"{qualname}.experts.gate_up_proj"
    return MoESpec(router=ParamSource(f"{qualname}.gate.weight"),
                   w1=ParamSource(gate_up, narrow=(1, 0, f)), w3=ParamSource(gate_up, narrow=(1, f, f)),
                   w2=ParamSource(f"{qualname}.experts.down_proj"),
                   experts=experts.num_experts, top_k=module.top_k, ffn_hidden=f, hidden=experts.hidden_dim)
