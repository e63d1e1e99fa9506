"""Pieces shared by the rules for transformers' families (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3):
their RMSNorm, their attention settings, their dense SwiGLU MLP and their fused-expert MoE layout
are the same code there."""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from moegraph.edges import AuxLoss
from moegraph.ir import ParamSource
from moegraph.lowering import (LoweringError, ModelOutput, ModelSpec, check_embedding, check_head, find_model_rule,
                               register_model)
from moegraph.lowering.blocks import AttentionSpec, MoESpec, NormSpec, MLPSpec

PROJECTIONS = {name: nn.Linear for name in ("q_proj", "k_proj", "v_proj", "o_proj")}


def rmsnorm(module: nn.Module, qualname: str) -> NormSpec:
    """transformers' T5-style RMSNorm: weight * (x * rsqrt(mean(x^2) + variance_epsilon))."""
    return NormSpec(ParamSource(f"{qualname}.weight"), module.variance_epsilon)


def check_attention(module: nn.Module, qualname: str, head_dim: int | None = None) -> None:
    """Raise naming the first attention setting the ATTENTION op does not compute (``head_dim``: the
    q/k head dim the scaling must match, module.head_dim unless given)."""
    cfg, where = module.config, f"{qualname} ({type(module).__name__})"
    window = getattr(module, "sliding_window", None) or getattr(cfg, "sliding_window", None)
    if window:
        raise LoweringError(f"{where}: sliding_window={window} (sliding-window attention) is not supported; "
                            "set config.sliding_window=None (Qwen2-MoE: use_sliding_window=False)")
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise LoweringError(f"{where}: rope_type {rope['rope_type']!r} is not supported (only 'default')")
    if module.training and module.attention_dropout > 0:
        raise LoweringError(f"{qualname}.attention_dropout={module.attention_dropout} in training mode: attention "
                            "dropout is not supported; set it to 0 or call .eval()")
    head_dim = module.head_dim if head_dim is None else head_dim
    if module.scaling != head_dim ** -0.5:
        raise LoweringError(f"{qualname}.scaling={module.scaling}: only the q/k head dim {head_dim}**-0.5 is supported")
    if not module.is_causal:
        raise LoweringError(f"{qualname}.is_causal=False: only causal attention is supported")
    check_attention_kernel(module, qualname)


def check_attention_kernel(module: nn.Module, qualname: str) -> None:
    """The attention function the module's forward dispatches to (``config._attn_implementation``
    through transformers' AttentionInterface) must be one whose math the ATTENTION op reproduces:
    the family's own ``eager_attention_forward`` or transformers' ``sdpa_attention_forward``
    (checked by identity, so a kernel registered under either name is caught too)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    impl = module.config._attn_implementation
    own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get(impl, own)     # as the forward's get_interface(impl, eager_attention_forward)
    eager = (getattr(fn, "__module__", None) == type(module).__module__
             and getattr(fn, "__qualname__", None) == "eager_attention_forward")
    if fn is not sdpa_attention_forward and not eager:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        raise LoweringError(f"{qualname} ({type(module).__name__}): attn_implementation={impl!r} runs {name}, which "
                            "the compiler does not model; only 'eager' and 'sdpa' (transformers' own functions) are "
                            "supported: load the model with attn_implementation='sdpa' (or "
                            "model.set_attn_implementation('sdpa'))")


def qkv_bias(module: nn.Module, qualname: str) -> tuple[ParamSource, ParamSource, ParamSource] | None:
    """The q/k/v projection biases, if all three have one (a partial set is left to the coverage check)."""
    names = ("q_proj", "k_proj", "v_proj")
    if all(getattr(module, name).bias is not None for name in names):
        return tuple(ParamSource(f"{qualname}.{name}.bias") for name in names)
    return None


def attention(module: nn.Module, qualname: str, **extra) -> AttentionSpec:
    """GQA attention with projections q/k/v/o_proj (q/k/v biases if all three have one) and default
    RoPE; ``extra`` fills the spec fields a family adds (OLMoE's q_norm, k_norm)."""
    check_attention(module, qualname)
    cfg = module.config
    p = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return AttentionSpec(q=p("q_proj"), k=p("k_proj"), v=p("v_proj"), o=p("o_proj"),
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=module.head_dim, rope_theta=float(cfg.rope_parameters["rope_theta"]),
                         tuple_output=True, qkv_bias=qkv_bias(module, qualname), **extra)


def check_silu(module: nn.Module, qualname: str) -> None:
    if module.act_fn.__class__.__name__ not in ("SiLU", "SiLUActivation"):
        raise LoweringError(f"{qualname}: activation {module.act_fn!r} is not SiLU (SwiGLU)")


def mlp(module: nn.Module, qualname: str) -> MLPSpec:
    """A dense SwiGLU MLP with nn.Linear gate_proj, up_proj, down_proj (no biases) and SiLU."""
    check_silu(module, qualname)
    for sub in ("gate_proj", "up_proj", "down_proj"):
        if type(getattr(module, sub)) is not nn.Linear:
            raise LoweringError(f"{qualname}.{sub} ({type(getattr(module, sub)).__name__}) is not nn.Linear")
    q = lambda name: ParamSource(f"{qualname}.{name}.weight")  # noqa: E731
    return MLPSpec(w1=q("gate_proj"), w3=q("up_proj"), w2=q("down_proj"), ffn_hidden=module.intermediate_size,
                   hidden=module.hidden_size)


def fused_experts(module: nn.Module, qualname: str, *, normalize: bool,
                  shared: MLPSpec | None = None, **router) -> MoESpec:
    """A block with ``gate`` (router weight [E, h]) and ``experts`` (fused ``gate_up_proj``
    [E, 2*h_ffn, h], read as two narrowed halves: gate (w1) then up (w3); ``down_proj``);
    ``router`` fills MoESpec's router fields beyond softmax top-k (DeepSeek-V3)."""
    experts = module.experts
    check_silu(experts, f"{qualname}.experts")
    f = experts.intermediate_dim
    gate_up = f"{qualname}.experts.gate_up_proj"
    return MoESpec(router=ParamSource(f"{qualname}.gate.weight"),
                   w1=ParamSource(gate_up, narrow=(1, 0, f)), w3=ParamSource(gate_up, narrow=(1, f, f)),
                   w2=ParamSource(f"{qualname}.experts.down_proj"), experts=experts.num_experts,
                   top_k=module.gate.top_k, ffn_hidden=f, hidden=experts.hidden_dim, normalize=normalize,
                   shared=shared, **router)


def base_model(model: nn.Module) -> ModelSpec:
    """A family's base model (embed_tokens, layers, norm, rotary_emb; children checked by its rule):
    returns the final norm's output. Its layers compute RoPE themselves from the config (the
    attention rule reads rope_theta), so the rotary module must hold exactly the default RoPE."""
    cfg = model.config
    check_embedding(model.embed_tokens, "embed_tokens")
    if len(model.layers) != cfg.num_hidden_layers:
        raise LoweringError(f"layers: {len(model.layers)} decoder layers but config.num_hidden_layers="
                            f"{cfg.num_hidden_layers} (forward runs only the first num_hidden_layers)")
    check_rotary(model.rotary_emb, "rotary_emb")
    odd = sorted({t for t in getattr(cfg, "layer_types", None) or () if t != "full_attention"})
    if odd:
        raise LoweringError(f"config.layer_types has {', '.join(odd)} layers: only full causal attention is supported")
    unused = {f"rotary_emb.{name}": "the default RoPE frequencies, recomputed from rope_theta by each layer's "
              "attention (check_rotary compared them)" for name, _ in model.rotary_emb.named_buffers()}
    return ModelSpec(embed="embed_tokens.weight", padding_idx=model.embed_tokens.padding_idx, layers="layers",
                     norm=rmsnorm(model.norm, "norm"), head=None, output=ModelOutput.HIDDEN, unused=unused)


def check_rotary(rotary: nn.Module, qualname: str) -> None:
    """Default RoPE, unscaled, with the frequencies the config's rope_theta gives."""
    if rotary.rope_type != "default":
        raise LoweringError(f"{qualname}.rope_type={rotary.rope_type!r}: only 'default' RoPE is supported")
    if rotary.attention_scaling != 1.0:
        raise LoweringError(f"{qualname}.attention_scaling={rotary.attention_scaling}: only unscaled RoPE (1.0) "
                            "is supported")
    expected, _ = rotary.compute_default_rope_parameters(rotary.config)
    if rotary.inv_freq.dtype != expected.dtype:
        # model.to(torch.bfloat16) casts the buffer too: eager then rotates with the rounded
        # frequencies, the compiled layers with rope_theta's exact ones
        raise LoweringError(f"{qualname}.inv_freq is {rotary.inv_freq.dtype}, not {expected.dtype} (a cast such as "
                            "model.to(torch.bfloat16) casts the RoPE buffers too, and eager then rotates with rounded "
                            "frequencies the compiled layers do not use): build the model in that dtype instead "
                            "(from_pretrained(..., dtype=...), or construct it under torch.set_default_dtype), which "
                            f"keeps them {expected.dtype}, or recompute them after the cast: r.inv_freq = "
                            f"r.compute_default_rope_parameters(r.config)[0] for r the {qualname} module "
                            f"(model.model.{qualname} of a ForCausalLM)")
    if not torch.equal(rotary.inv_freq.detach().cpu().float(), expected.float()):
        raise LoweringError(f"{qualname}.inv_freq differs from the default RoPE frequencies of rope_theta="
                            f"{rotary.config.rope_parameters['rope_theta']}: the layers would compute other rotations")


def causal_lm(model: nn.Module) -> ModelSpec:
    """A family's ForCausalLM: ``model`` (its base model, recognised by its own rule) and an
    ``lm_head`` (tied to the embedding or not); the loss is transformers' mean next-token cross-entropy, plus the
    router's auxiliary load-balancing loss where it adds one (``aux_loss``)."""
    tied = check_head(model, model.lm_head, model.model.embed_tokens, "lm_head")
    base = prefixed(find_model_rule(model.model).spec(model.model), "model.")
    return dataclasses.replace(base, head="lm_head.weight", output=ModelOutput.CAUSAL_LM, aux_loss=aux_loss(model),
                               tied=tied)


def aux_loss(model: nn.Module) -> AuxLoss | None:
    """The auxiliary load-balancing loss a ForCausalLM adds with config.output_router_logits=True:
    Mixtral, Qwen2-MoE and OLMoE call their module's ``load_balancing_loss_func`` (the same
    function in each: softmax of every layer's router logits, top-k counts, no z-loss; their
    norm_topk_prob renormalises the routing weights only, not this loss) with the model's
    num_experts and num_experts_per_tok, and add router_aux_loss_coef times it when labels are
    given. A family without that function (DeepSeek-V3) never reads the flag: its loss is
    unchanged, as is the base model's output. A zero coefficient still returns the term as
    ``.aux_loss`` (transformers computes it whenever the flag is set; a caller may weight it)."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    if getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None) is None:
        return None
    for attr in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok"):
        if not hasattr(model, attr):
            raise LoweringError(f"{type(model).__name__} has no {attr}: its auxiliary load-balancing loss "
                                "(output_router_logits=True) is not the one modelled; set output_router_logits=False")
    coef = model.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise LoweringError(f"{type(model).__name__}.router_aux_loss_coef={coef!r}: only a coefficient >= 0 is "
                            "supported")
    return AuxLoss(float(coef), model.num_experts, model.num_experts_per_tok)


def prefixed(spec: ModelSpec, prefix: str) -> ModelSpec:
    """``spec`` of a submodule, its names as seen from the parent (``prefix`` ends in a dot)."""
    return dataclasses.replace(spec, embed=prefix + spec.embed, layers=prefix + spec.layers,
                               norm=NormSpec(ParamSource(prefix + spec.norm.weight.qualname), spec.norm.eps),
                               head=None if spec.head is None else prefix + spec.head,
                               unused={prefix + k: v for k, v in spec.unused.items()})


def register_models(base: type, causal_lm_cls: type, norm: type, rotary: type) -> None:
    """Model rules for a family's base model and its ForCausalLM (the same four children and
    the same head in every family today)."""
    register_model(base, children={"embed_tokens": nn.Embedding, "layers": nn.ModuleList, "norm": norm,
                                   "rotary_emb": rotary})(base_model)
    register_model(causal_lm_cls, children={"model": base, "lm_head": nn.Linear})(causal_lm)
