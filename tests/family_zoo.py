"""Tiny causal LMs of every MoE family in the installed transformers, for the family tests and
``benchmarks/families_table.py``.

Each family's own config class is built with its defaults overridden by the size fields it has
(hidden 64, 8 heads of 8, 4 kv heads, 8 experts top-2, expert h_ffn 32, 2 layers, vocab 64, ...),
plus a small per-family row where a family names a field differently or needs one to make its two
layers identical (a compiled model stacks one lowered layer): nested sub-configs shrunk with their
own field names (DBRX's attn_config and ffn_config), the values its validators demand (DeepSeek-V4's
MLP types, Zaya's one expert per token), heterogeneous per-layer configs made homogeneous
(Dots3Note, Gemma4: no per-layer overrides). Weights are drawn N(0, 0.2), buffers (score-correction
biases) too, so that no bias or norm weight hides how it is used.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import torch
from torch import nn

VOCAB, H, LAYERS = 64, 64, 2

# size fields by their transformers names; a field a config lacks is skipped
SIZES = {
    "hidden_size": H, "intermediate_size": 96, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
    "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "num_local_experts": 8, "num_experts": 8, "n_routed_experts": 8,
    "moe_num_experts": 8, "num_experts_per_tok": 2, "moe_k": 2, "moe_topk": 2, "n_shared_experts": 1,
    "moe_num_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 0, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "kv_lora_rank": 16, "q_lora_rank": 24,
    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 20, "mlp_only_layers": [],
    "decoder_sparse_step": 1, "moe_layer_freq": 1, "use_sliding_window": False, "moe_layer_start_index": 0,
    "mlp_layer_types": ["sparse"] * LAYERS,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02,
}

# per-family overrides (fields named differently, or layers made identical)
ROWS: dict[str, dict] = {
    "deepseek_v3": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "deepseek_v2": {"n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy", "routed_scaling_factor": 2.0},
    "glm4_moe": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5, "use_qk_norm": True,
                 "partial_rotary_factor": 0.5, "attention_bias": True},
    "dots1": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5},
    "gpt_oss": {"layer_types": ["sliding_attention"] * LAYERS, "sliding_window": 6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
    "llama4": {"no_rope_layers": [1] * LAYERS, "interleave_moe_layer_step": 1, "attention_chunk_size": 8,
               "intermediate_size_mlp": 96, "layer_types": ["chunked_attention"] * LAYERS},
    "qwen2_moe": {"qkv_bias": True},
    # its own default norm (rms_norm_eps=None: a bias-free LayerNorm, in the layers and at the model's end)
    "cohere2_moe": {"rms_norm_eps": None},
    # a routed scaling other than its default 1 (the router's route_scale)
    "afmoe": {"route_scale": 2.5},
    "axk1": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
    "granitemoe_swa": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6,
                       "layer_rope_theta": [10000.0, 0]},
    # nested sub-configs, shrunk with their own field names; clip_qkv and rope_theta as dbrx-instruct's
    # config.json gives them (its attention reads attn_config.rope_theta, which the class does not declare)
    # (d_model by its own name: its __post_init__ copies it into ffn_config before the alias hidden_size lands)
    "dbrx": {"d_model": H, "attn_config": {"kv_n_heads": 4, "clip_qkv": 8.0, "rope_theta": 500000.0},
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2}},
    # its validators: MLP types of its own names ('moe', no hash routing), no compressed layers
    "deepseek_v4": {"mlp_layer_types": ["moe"] * LAYERS, "layer_types": ["sliding_attention"] * LAYERS},
    # heterogeneous per-layer configs made homogeneous (no per-layer overrides); MoE layers
    "dots3_note": {"per_layer_config": {}, "mlp_layer_types": ["sparse"] * LAYERS},
    # its MoE variant (enable_moe_block, as the 26B-A4B), without per-layer inputs
    "gemma4": {"per_layer_config": {}, "enable_moe_block": True, "top_k_experts": 2, "hidden_size_per_layer_input": 0,
               "vocab_size_per_layer_input": VOCAB},
    # a hybrid: LFM2-8B-A1B's layers mix short convolutions and attention (its default leaves them unset)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    # its validator: one expert per token
    "zaya": {"num_experts_per_tok": 1},
    # a linear-attention (Gated DeltaNet) layer and a full-attention one, its own ratio's two kinds; 2 key heads
    # of 8 serving 4 value heads of 8 (n = 2 splits both), a 4-wide convolution
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                   "linear_conv_kernel_dim": 4},
    # the same two kinds with Qwen3.5-MoE's separate projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    "qwen3_5_moe": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                    "linear_conv_kernel_dim": 4},
    # Kimi Linear: a Kimi Delta Attention layer (4 heads of 8, a 4-wide convolution) and an MLA one (NoPE, q
    # projected directly as Kimi-Linear-48B's q_lora_rank=None); DeepSeek-V3's grouped sigmoid router
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"], "linear_num_heads": 4, "linear_head_dim": 8,
                    "linear_conv_kernel_dim": 4, "q_lora_rank": None, "n_group": 4, "topk_group": 2},
    # its head_dim is the q/k head dim (nope + rope, as its config derives it when not given): its rotary
    # module rotates head_dim * partial_rotary_factor = qk_rope_head_dim features
    "mistral4": {"head_dim": SIZES["qk_head_dim"]},
}


def moe_causal_lms() -> list[tuple[str, str]]:
    """(family, ForCausalLM class) for every installed transformers modeling file that defines an
    MoE block (read from the source: importing ~500 models is slow)."""
    import transformers
    moe = re.compile(r"^class \w*(Experts|SparseMoe|MoE|Moe)\w*\(", re.M)
    lm = re.compile(r"^class (\w+ForCausalLM)\(", re.M)
    found = []
    for f in sorted((pathlib.Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        if f.stem != f"modeling_{f.parent.name}":
            continue
        text = f.read_text()
        if "experts" in text and moe.search(text):
            found += [(f.parent.name, cls) for cls in lm.findall(text)]
    return found


def _has(config, field: str) -> bool:
    """Whether the config has the field (a per-layer attribute of a heterogeneous config counts:
    reading it globally raises)."""
    try:
        return hasattr(config, field)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return True


def tiny_config(family: str, cls_name: str, **overrides):
    """The family's config at the tiny sizes (module docstring)."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config_cls = getattr(mod, cls_name).config_class
    base = config_cls()
    fields = set(base.to_dict()) | {k for k in SIZES if _has(base, k)}
    kwargs = {k: v for k, v in SIZES.items() if k in fields}
    if "kv_lora_rank" in fields:                      # latent attention: one k and v per head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 8)
    types = base.to_dict().get("layer_types") if "layer_types" in fields else None
    if types is not None and set(types) <= {"full_attention", "sliding_attention", "chunked_attention"}:
        kwargs["layer_types"] = ["full_attention"] * LAYERS    # identical layers (a stack lowers one)
    elif types is not None:                                     # a hybrid: its own first layer types
        kwargs["layer_types"] = list(types[:LAYERS])
    kwargs |= ROWS.get(family, {}) | overrides
    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "sdpa" if getattr(getattr(mod, cls_name), "_supports_sdpa", True) else "eager"
    cfg._experts_implementation = "eager"
    return cfg


def tiny_model(family: str, cls_name: str, seed: int = 0, **overrides) -> nn.Module:
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg = tiny_config(family, cls_name, **overrides)
    torch.manual_seed(seed)
    model = getattr(mod, cls_name)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if b.is_floating_point() and "rotary" not in name and "inv_freq" not in name:
                b.normal_(0, 0.2)
    return model.float()


def with_edge_head(model: nn.Module, softcap: float | None = None, norm_bias: bool = False) -> nn.Module:
    """``model`` (a compiled family's tiny causal LM) with the model edges of families that do not
    compile for their layers: a final LayerNorm with a bias (PhiMoE's: ``nn.LayerNorm``, weight and
    bias drawn as the zoo's) and/or Beam's logit soft cap: the causal LM becomes a user's subclass
    whose forward is Beam's head (``config.final_logit_softcapping`` = ``softcap``), compiled by the
    structural causal-LM rule registered for it (``register_model``: the documented way to compile
    a class of one's own)."""
    if norm_bias:
        h = model.config.hidden_size
        norm = nn.LayerNorm(h, eps=1e-5)
        with torch.no_grad():
            norm.weight.normal_(1, 0.2), norm.bias.normal_(0, 0.2)
        model.model.norm = norm
    if softcap is not None:
        model.config.final_logit_softcapping = softcap
        model.__class__ = _softcapped(type(model), type(model.model))
    return model


_SOFTCAPPED: dict[type, type] = {}


def _softcapped(base: type, base_model: type) -> type:
    """A subclass of the causal LM ``base`` whose forward soft-caps its logits as Beam's does, with the
    structural causal-LM rule registered for it."""
    if base in _SOFTCAPPED:
        return _SOFTCAPPED[base]
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from moegraph.lowering import register_model
    from moegraph.lowering.hf_common import causal_lm

    class Softcapped(base):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None,
                    **kwargs):
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=use_cache)
            logits = self.lm_head(outputs.last_hidden_state)
            if self.config.final_logit_softcapping is not None:         # modeling_beam.BeamForCausalLM's lines
                logits = logits.float() / self.config.final_logit_softcapping
                logits = torch.tanh(logits)
                logits = logits * self.config.final_logit_softcapping
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    Softcapped.__name__ = f"Softcapped{base.__name__}"
    register_model(Softcapped, children={"model": base_model, "lm_head": nn.Linear})(causal_lm)
    _SOFTCAPPED[base] = Softcapped
    return Softcapped
