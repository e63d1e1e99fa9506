"""Rules for Hugging Face transformers' Mixtral (MixtralDecoderLayer and its parts).

Plain torch.fx cannot trace MixtralSparseMoeBlock (its expert loop depends on the routing),
so the tracer keeps these modules as leaves and these rules describe them. The fused
``gate_up_proj`` [E, 2*h_ffn, h] is read as two narrowed halves: gate (w1) then up (w3).
Every setting these modules read that the block specs do not model raises, naming it.
"""

from __future__ import annotations

from torch import nn
from transformers.models.mixtral import modeling_mixtral as hf

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec

_LINEARS = {name: nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


@register(hf.MixtralRMSNorm)
def rmsnorm(module: hf.MixtralRMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.variance_epsilon)


def check_attention(module: nn.Module, qualname: str) -> None:
    """Raise naming the first attention setting the ATTENTION op does not compute."""
    cfg, where = module.config, f"{qualname} ({type(module).__name__})"
    if getattr(cfg, "sliding_window", None):
        raise LoweringError(f"{where}: config.sliding_window={cfg.sliding_window} (sliding-window attention) "
                            "is not supported; set it to None")
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise LoweringError(f"{where}: rope_type {rope['rope_type']!r} is not supported (only 'default')")
    if module.training and module.attention_dropout > 0:
        raise LoweringError(f"{qualname}.attention_dropout={module.attention_dropout} in training mode: attention "
                            "dropout is not supported; set it to 0 or call .eval()")
    if module.scaling != module.head_dim ** -0.5:
        raise LoweringError(f"{qualname}.scaling={module.scaling}: only head_dim**-0.5 is supported")
    if not module.is_causal:
        raise LoweringError(f"{qualname}.is_causal=False: only causal attention is supported")


@register(hf.MixtralAttention, children=_LINEARS)
def attention(module: hf.MixtralAttention, qualname: str) -> AttentionSpec:
    check_attention(module, qualname)
    cfg = module.config
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"),
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=module.head_dim, rope_theta=float(cfg.rope_parameters["rope_theta"]),
                         tuple_output=True)


@register(hf.MixtralSparseMoeBlock, children={"gate": hf.MixtralTopKRouter, "experts": hf.MixtralExperts})
def sparse_moe(module: hf.MixtralSparseMoeBlock, qualname: str) -> MoESpec:
    experts = module.experts
    if module.training and module.jitter_noise:
        raise LoweringError(f"{qualname} ({type(module).__name__}): router_jitter_noise={module.jitter_noise} "
                            "is random per step and cannot be reproduced; set it to 0")
    if experts.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        raise LoweringError(f"{qualname}.experts: activation {experts.act_fn!r} is not SiLU (SwiGLU)")
    f = experts.intermediate_dim
    gate_up = f"{qualname}.experts.gate_up_proj"
    return MoESpec(router=ParamSource(f"{qualname}.gate.weight"),
                   w1=ParamSource(gate_up, narrow=(1, 0, f)), w3=ParamSource(gate_up, narrow=(1, f, f)),
                   w2=ParamSource(f"{qualname}.experts.down_proj"),
                   experts=experts.num_experts, top_k=module.gate.top_k, ffn_hidden=f, hidden=experts.hidden_dim)
