"""The eager reference modules `moegraph run` checks against and measures beside: the
project's reference layer (``moegraph.models.MoETransformerLayer``) or transformers'
MixtralDecoderLayer of the same sizes, with seeded random weights identical on every rank, one
layer or a stack."""

from __future__ import annotations

from typing import Any, Literal

from moegraph.runtime import RuntimeFailure

# Which eager module supplies the parameters (their names are the graph's): the project's
# reference layer, or transformers' MixtralDecoderLayer of the same sizes (held-out validation)
Implementation = Literal["reference", "hf-mixtral"]


def hf_mixtral_layer(cfg: Any):
    """transformers' MixtralDecoderLayer with ``cfg``'s sizes; refuses what Mixtral cannot express."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    head_dim = cfg.head_dim or cfg.hidden // cfg.heads
    unlike = [name for name, differs in (("shared experts", cfg.shared_experts), ("q/k/v biases", cfg.qkv_bias),
                                         ("q/k norms", cfg.qk_norm), ("un-normalised top-k", not cfg.normalize_topk),
                                         ("head_dim * heads != hidden", head_dim * cfg.heads != cfg.hidden),
                                         ("multi-head latent attention", cfg.kv_lora_rank is not None),
                                         (f"{cfg.router_scoring} router scores", cfg.router_scoring != "softmax"),
                                         ("expert groups", cfg.n_group > 1),
                                         ("routed scaling", cfg.routed_scaling_factor != 1.0))
              if differs]
    if unlike:
        raise RuntimeFailure(f"model {cfg.name} has {', '.join(unlike)}, which transformers' MixtralDecoderLayer "
                             "does not; use the reference implementation")
    hf = MixtralConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden, num_attention_heads=cfg.heads,
                       num_key_value_heads=cfg.kv_heads, num_local_experts=cfg.experts,
                       num_experts_per_tok=cfg.top_k, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
                       attn_implementation="sdpa")
    return MixtralDecoderLayer(hf, 0)


def eager_call(module: Any, implementation: Implementation):
    """How to call ``implementation``'s eager module on x [b, s, h]; None: ``module(x)``."""
    if implementation == "reference":
        return None
    if implementation == "hf-mixtral":
        import torch
        from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding
        rotary = MixtralRotaryEmbedding(module.self_attn.config)   # transformers computes RoPE outside the layer

        def call(layer, x):
            cos_sin = rotary.to(x.device)(x, torch.arange(x.shape[1], device=x.device)[None])
            return layer(x, position_embeddings=cos_sin, attention_mask=None)
        return call
    raise RuntimeFailure(f"implementation {implementation!r} is not one of reference, hf-mixtral")


def seeded_layer(cfg: Any, seed: int, dtype: str = "fp32", implementation: Implementation = "reference"):
    """The reference layer (or ``implementation``'s) with reproducible random weights: the same on every rank.

    Matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2) (not all ones, so their
    gradients are exercised), buffers (the router's score-correction bias) ~ N(0, 0.1^2)."""
    import torch
    from moegraph.models import MoETransformerLayer
    torch.manual_seed(seed)
    if implementation == "reference":
        layer = MoETransformerLayer.from_config(cfg)
    elif implementation == "hf-mixtral":
        layer = hf_mixtral_layer(cfg)
    else:
        raise RuntimeFailure(f"implementation {implementation!r} is not one of reference, hf-mixtral")
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(std=p.shape[-1] ** -0.5)
        for b in layer.buffers():      # DeepSeek-V3's score-correction bias: nonzero, so it steers the choice
            b.normal_(std=0.1)
    return layer.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


def seeded_stack(cfg: Any, seed: int, layers: int, dtype: str = "fp32",
                 implementation: Implementation = "reference"):
    """(eager module, its call) for a graph of ``layers`` stacked layers: one seeded layer
    (``seeded_layer``), or an nn.Module whose ``layers`` ModuleList (seeds seed, seed+1, ...;
    parameter names ``layers.{i}.<name>`` as moegraph.layers names them) runs in order."""
    import torch
    if layers == 1:
        module = seeded_layer(cfg, seed, dtype, implementation)
        return module, eager_call(module, implementation)
    module = torch.nn.Module()
    module.layers = torch.nn.ModuleList([seeded_layer(cfg, seed + i, dtype, implementation) for i in range(layers)])
    one = eager_call(module.layers[0], implementation)

    def call(stack, x):
        for layer in stack.layers:
            x = one(layer, x) if one else layer(x)
        return x
    return module, call
