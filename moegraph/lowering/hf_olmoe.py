"""Rules for Hugging Face transformers' OLMoE (OlmoeDecoderLayer and its parts).

Beyond Mixtral: q and k are RMS-normalised over their whole projection width (H*d and G*d)
before RoPE (AttentionSpec.q_norm / k_norm); under attention tp a rank holds only its heads'
part of that width, so the blocks add a cross-rank reduction of the sums of squares (an
ALL_REDUCE of [b, s, 1]). The router does not renormalise its top-k weights by default.
"""

from __future__ import annotations

from transformers.models.olmoe import modeling_olmoe as hf

from moegraph.lowering import LoweringError, hf_common, register
from moegraph.lowering.blocks import AttentionSpec, MoESpec
from moegraph.lowering.hf_common import PROJECTIONS, fused_experts, register_models, rmsnorm

register(hf.OlmoeRMSNorm)(rmsnorm)


@register(hf.OlmoeAttention, children=PROJECTIONS | {"q_norm": hf.OlmoeRMSNorm, "k_norm": hf.OlmoeRMSNorm})
def attention(module: hf.OlmoeAttention, qualname: str) -> AttentionSpec:
    cfg = module.config
    if cfg.clip_qkv is not None:
        raise LoweringError(f"{qualname}: config.clip_qkv={cfg.clip_qkv} (clamping q, k, v) is not supported; "
                            "set it to None")
    for name, width in (("q_norm", cfg.num_attention_heads), ("k_norm", cfg.num_key_value_heads)):
        if getattr(module, name).weight.shape[0] != width * module.head_dim:
            raise LoweringError(f"{qualname}.{name} normalises {getattr(module, name).weight.shape[0]} features, "
                                f"not the projection's {width * module.head_dim}")
    return hf_common.attention(module, qualname, q_norm=rmsnorm(module.q_norm, f"{qualname}.q_norm"),
                               k_norm=rmsnorm(module.k_norm, f"{qualname}.k_norm"))


@register(hf.OlmoeSparseMoeBlock, children={"gate": hf.OlmoeTopKRouter, "experts": hf.OlmoeExperts})
def sparse_moe(module: hf.OlmoeSparseMoeBlock, qualname: str) -> MoESpec:
    return fused_experts(module, qualname, normalize=bool(module.gate.norm_topk_prob))


register_models(hf.OlmoeModel, hf.OlmoeForCausalLM, hf.OlmoeRMSNorm, hf.OlmoeRotaryEmbedding)
