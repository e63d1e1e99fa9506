"""Rules for Hugging Face transformers' Qwen2-MoE (Qwen2MoeDecoderLayer and its parts).

Beyond Mixtral: q/k/v projections carry biases (AttentionSpec.qkv_bias, a BIAS op after the
QKV GEMM); the router does not renormalise its top-k weights by default (MoESpec.normalize);
a dense shared expert scaled by sigmoid(x @ shared_expert_gate.T) runs beside the routed
experts (MoESpec.shared, the SIGMOID_GATE op). Dense layers (``mlp_only_layers``,
``decoder_sparse_step``) have a Qwen2MoeMLP as their FFN (MLPSpec, as DeepSeek-V3's first layers).
"""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import MoESpec
from moegraph.lowering.hf_common import PROJECTIONS, attention, fused_experts, mlp, register_models, rmsnorm

register(hf.Qwen2MoeRMSNorm)(rmsnorm)
register(hf.Qwen2MoeAttention, children=PROJECTIONS)(attention)  # + q/k/v biases
register(hf.Qwen2MoeMLP, children={name: nn.Linear for name in ("gate_proj", "up_proj", "down_proj")})(mlp)


@register(hf.Qwen2MoeSparseMoeBlock, children={"gate": hf.Qwen2MoeTopKRouter, "experts": hf.Qwen2MoeExperts,
                                                "shared_expert": hf.Qwen2MoeMLP, "shared_expert_gate": nn.Linear})
def sparse_moe(module: hf.Qwen2MoeSparseMoeBlock, qualname: str) -> MoESpec:
    if module.shared_expert_gate.out_features != 1:
        raise LoweringError(f"{qualname}.shared_expert_gate has {module.shared_expert_gate.out_features} outputs, not 1")
    shared = dataclasses.replace(mlp(module.shared_expert, f"{qualname}.shared_expert"),
                                 gate=ParamSource(f"{qualname}.shared_expert_gate.weight"))
    return fused_experts(module, qualname, normalize=bool(module.gate.norm_topk_prob), shared=shared)


register_models(hf.Qwen2MoeModel, hf.Qwen2MoeForCausalLM, hf.Qwen2MoeRMSNorm, hf.Qwen2MoeRotaryEmbedding)
