"""Rules for Hugging Face transformers' Mixtral (MixtralDecoderLayer and its parts).

Plain torch.fx cannot trace MixtralSparseMoeBlock (its expert loop depends on the routing),
so the tracer keeps these modules as leaves and these rules describe them. Every setting these
modules read that the block specs do not model raises, naming it.
"""

from __future__ import annotations

from transformers.models.mixtral import modeling_mixtral as hf

from moegraph.lowering import LoweringError, register
from moegraph.lowering.blocks import MoESpec
from moegraph.lowering.hf_common import PROJECTIONS, attention, fused_experts, register_models, rmsnorm

register(hf.MixtralRMSNorm)(rmsnorm)
register(hf.MixtralAttention, children=PROJECTIONS)(attention)


@register(hf.MixtralSparseMoeBlock, children={"gate": hf.MixtralTopKRouter, "experts": hf.MixtralExperts})
def sparse_moe(module: hf.MixtralSparseMoeBlock, qualname: str) -> MoESpec:
    if module.training and module.jitter_noise:
        raise LoweringError(f"{qualname} ({type(module).__name__}): router_jitter_noise={module.jitter_noise} "
                            "is random per step and cannot be reproduced; set it to 0")
    return fused_experts(module, qualname, normalize=True)


register_models(hf.MixtralModel, hf.MixtralForCausalLM, hf.MixtralRMSNorm, hf.MixtralRotaryEmbedding)
