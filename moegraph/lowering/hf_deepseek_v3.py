"""Rules for Hugging Face transformers' DeepSeek-V3 (DeepseekV3DecoderLayer and its parts).

Beyond Mixtral:
  * multi-head latent attention (MLASpec, the MLA_HEADS op): low-rank q and kv projections with
    their RMSNorms, RoPE on the last qk_rope_head_dim of each q/k head (one k_pe shared by every
    head; interleaved pairs when config.rope_interleave), q/k head dim differing from v's;
  * the router: sigmoid scores, the score-correction bias (a buffer, e_score_correction_bias,
    used for the choice only), grouped top-k (n_group, topk_group), norm_topk_prob and
    routed_scaling_factor (MoESpec's router fields; ROUTER attrs scoring="sigmoid");
  * shared experts (n_shared_experts of them fused into one dense SwiGLU, no gate: MoESpec.shared);
  * dense first layers (layer_idx < first_k_dense_replace): the MLP is a DeepseekV3MLP (MLPSpec).
"""

from __future__ import annotations

from torch import nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import MLASpec, MoESpec
from moegraph.lowering.hf_common import check_attention, fused_experts, mlp, register_models, rmsnorm

register(hf.DeepseekV3RMSNorm)(rmsnorm)


register(hf.DeepseekV3MLP, children={name: nn.Linear for name in ("gate_proj", "up_proj", "down_proj")})(mlp)


# the q side's children depend on q_lora_rank: checked in the rule
@register(hf.DeepseekV3Attention, methods=("expand_kv",),
          children={"kv_a_proj_with_mqa": nn.Linear, "kv_a_layernorm": hf.DeepseekV3RMSNorm,
                    "kv_b_proj": nn.Linear, "o_proj": nn.Linear})
def attention(module: hf.DeepseekV3Attention, qualname: str) -> MLASpec:
    cfg = module.config
    check_attention(module, qualname, head_dim=module.qk_head_dim)
    if cfg.attention_bias:
        raise LoweringError(f"{qualname} ({type(module).__name__}): config.attention_bias=True (biases on q_a_proj, "
                            "kv_a_proj_with_mqa, o_proj) is not supported")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise LoweringError(f"{qualname}: num_key_value_heads={cfg.num_key_value_heads} differs from "
                            f"num_attention_heads={cfg.num_attention_heads}; MLA expands one k and v per head")
    if module.qk_rope_head_dim % 2:
        raise LoweringError(f"{qualname}: qk_rope_head_dim={module.qk_rope_head_dim} is odd; RoPE rotates pairs")
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    low_rank = module.q_lora_rank is not None
    expected = {"q_a_proj": nn.Linear, "q_a_layernorm": hf.DeepseekV3RMSNorm, "q_b_proj": nn.Linear} if low_rank \
        else {"q_proj": nn.Linear}
    for attr, cls in expected.items():
        if type(getattr(module, attr, None)) is not cls:
            raise LoweringError(f"{qualname}.{attr} ({type(getattr(module, attr, None)).__name__}): the rule for "
                                f"DeepseekV3Attention assumes a {cls.__name__} here")
    return MLASpec(q=None if low_rank else p("q_proj"), q_a=p("q_a_proj") if low_rank else None,
                   q_norm=rmsnorm(module.q_a_layernorm, f"{qualname}.q_a_layernorm") if low_rank else None,
                   q_b=p("q_b_proj") if low_rank else None, kv_a=p("kv_a_proj_with_mqa"),
                   kv_norm=rmsnorm(module.kv_a_layernorm, f"{qualname}.kv_a_layernorm"), kv_b=p("kv_b_proj"),
                   o=p("o_proj"), heads=module.num_heads, nope_dim=module.qk_nope_head_dim,
                   rope_dim=module.qk_rope_head_dim, v_dim=module.v_head_dim, q_rank=module.q_lora_rank,
                   kv_rank=module.kv_lora_rank, rope_theta=float(cfg.rope_parameters["rope_theta"]),
                   rope_interleave=bool(cfg.rope_interleave))


@register(hf.DeepseekV3MoE, children={"gate": hf.DeepseekV3TopkRouter, "experts": hf.DeepseekV3Experts,
                                       "shared_experts": hf.DeepseekV3MLP})
def moe(module: hf.DeepseekV3MoE, qualname: str) -> MoESpec:
    gate = module.gate
    if gate.num_experts % gate.num_group or gate.num_experts // gate.num_group < 2:
        raise LoweringError(f"{qualname}.gate: n_group={gate.num_group} must split the {gate.num_experts} experts "
                            "into equal groups of at least 2 (a group ranks by its two best scores)")
    if not 1 <= gate.topk_group <= gate.num_group:
        raise LoweringError(f"{qualname}.gate: topk_group={gate.topk_group} is not between 1 and n_group={gate.num_group}")
    if gate.top_k > gate.topk_group * gate.num_experts // gate.num_group:
        raise LoweringError(f"{qualname}.gate: top_k={gate.top_k} exceeds the {gate.topk_group} kept groups' experts")
    return fused_experts(module, qualname, normalize=bool(gate.norm_topk_prob),
                         shared=mlp(module.shared_experts, f"{qualname}.shared_experts"), scoring="sigmoid",
                         score_bias=ParamSource(f"{qualname}.gate.e_score_correction_bias"), groups=gate.num_group,
                         topk_groups=gate.topk_group, scale=float(gate.routed_scaling_factor))


register_models(hf.DeepseekV3Model, hf.DeepseekV3ForCausalLM, hf.DeepseekV3RMSNorm, hf.DeepseekV3RotaryEmbedding)
