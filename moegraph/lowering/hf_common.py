"""Pieces shared by the rules for transformers' families (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3):
their RMSNorm, their attention settings, their dense SwiGLU MLP and their fused-expert MoE layout
are the same code there."""

from __future__ import annotations

from torch import nn

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError
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
