"""Rules for Hugging Face transformers' Qwen2-MoE (Qwen2MoeDecoderLayer and its parts).

Beyond Mixtral: q/k/v projections carry biases (AttentionSpec.qkv_bias, a BIAS op after the
QKV GEMM); the router does not renormalise its top-k weights by default (MoESpec.normalize);
a dense shared expert scaled by sigmoid(x @ shared_expert_gate.T) runs beside the routed
experts (MoESpec.shared, the SIGMOID_GATE op). Dense layers (``mlp_only_layers``,
``decoder_sparse_step``) have no rule yet and raise, naming ``mlp`` (Qwen2MoeMLP).
"""

from __future__ import annotations

from torch import nn
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec, SharedExpertSpec
from moegraph.lowering.hf_mixtral import check_attention

_LINEARS = {name: nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


@register(hf.Qwen2MoeRMSNorm)
def rmsnorm(module: hf.Qwen2MoeRMSNorm, qualname: str) -> NormSpec:
    return NormSpec(ParamSource(f"{qualname}.weight"), module.variance_epsilon)


@register(hf.Qwen2MoeAttention, children=_LINEARS)
def attention(module: hf.Qwen2MoeAttention, qualname: str) -> AttentionSpec:
    check_attention(module, qualname)
    if getattr(module, "sliding_window", None):
        raise LoweringError(f"{qualname}.sliding_window={module.sliding_window} (a sliding-attention layer) is not "
                            "supported; set config.use_sliding_window=False")
    cfg = module.config
    p = lambda name, what="weight": ParamSource(f"{qualname}.{name}.{what}")  # noqa: E731
    biases = [module.q_proj.bias is not None, module.k_proj.bias is not None, module.v_proj.bias is not None]
    if any(biases) and not all(biases):
        raise LoweringError(f"{qualname}: only some of q_proj, k_proj, v_proj have a bias; all or none are supported")
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"),
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=module.head_dim, rope_theta=float(cfg.rope_parameters["rope_theta"]),
                         tuple_output=True,
                         qkv_bias=(p("q_proj", "bias"), p("k_proj", "bias"), p("v_proj", "bias")) if all(biases) else None)


def _silu(module: nn.Module, qualname: str) -> None:
    if module.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        raise LoweringError(f"{qualname}: activation {module.act_fn!r} is not SiLU (SwiGLU)")


@register(hf.Qwen2MoeSparseMoeBlock, children={"gate": hf.Qwen2MoeTopKRouter, "experts": hf.Qwen2MoeExperts,
                                                "shared_expert": hf.Qwen2MoeMLP, "shared_expert_gate": nn.Linear})
def sparse_moe(module: hf.Qwen2MoeSparseMoeBlock, qualname: str) -> MoESpec:
    experts, shared = module.experts, module.shared_expert
    _silu(experts, f"{qualname}.experts")
    _silu(shared, f"{qualname}.shared_expert")
    for sub in ("gate_proj", "up_proj", "down_proj"):
        if type(getattr(shared, sub)) is not nn.Linear:
            raise LoweringError(f"{qualname}.shared_expert.{sub} ({type(getattr(shared, sub)).__name__}) is not nn.Linear")
    if module.shared_expert_gate.out_features != 1:
        raise LoweringError(f"{qualname}.shared_expert_gate has {module.shared_expert_gate.out_features} outputs, not 1")
    f, q = experts.intermediate_dim, lambda name: ParamSource(f"{qualname}.{name}")  # noqa: E731
    gate_up = f"{qualname}.experts.gate_up_proj"
    return MoESpec(router=q("gate.weight"),
                   w1=ParamSource(gate_up, narrow=(1, 0, f)), w3=ParamSource(gate_up, narrow=(1, f, f)),
                   w2=q("experts.down_proj"), experts=experts.num_experts, top_k=module.gate.top_k,
                   ffn_hidden=f, hidden=experts.hidden_dim, normalize=bool(module.gate.norm_topk_prob),
                   shared=SharedExpertSpec(w1=q("shared_expert.gate_proj.weight"), w3=q("shared_expert.up_proj.weight"),
                                           w2=q("shared_expert.down_proj.weight"),
                                           ffn_hidden=shared.intermediate_size, gate=q("shared_expert_gate.weight")))
