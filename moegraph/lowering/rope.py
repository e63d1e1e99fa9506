"""RoPE of a transformers family, read from its own rotary module.

A layer's rotation is what its family's rotary embedding computes for it: the module's
``inv_freq`` and ``attention_scaling`` (transformers' ROPE_INIT_FUNCTIONS for the config's
rope_type), or, where ``config.rope_parameters`` is keyed by layer type (Laguna, Mellum,
MiMo-V2-Flash: full and sliding layers with their own theta and partial rotary factor), its
``<type>_inv_freq`` and ``<type>_attention_scaling``; where ``config.layer_rope_theta`` gives each
layer its own theta (GraniteMoeSWA: 0 for a NoPE layer), the rotary module its model builds from the
config with that theta (``layer_rope_config``). Notation: d head dim, d_r rotated dims.
"""

from __future__ import annotations

import copy
import importlib
import inspect

import torch
from torch import nn

from moegraph.lowering import LoweringError
from moegraph.lowering.specs import RopeSpec


def rope_of(cfg, head_dim: int, where: str, layer_type: str, family: str | None) -> RopeSpec:
    """RoPE as the family's rotary module computes it for a layer of type ``layer_type`` (its
    config.layer_types entry) in the transformers folder ``family``: its inverse frequencies and
    cos/sin scale (transformers' ROPE_INIT_FUNCTIONS for the config's rope_type, or per layer type
    where rope_parameters is keyed by config.layer_types: Laguna, Mellum, MiMo-V2-Flash), rotating
    the first 2*len(inv_freq) dims of each head. Types whose frequencies change with the sequence
    (dynamic, longrope) are refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params, keyed = rope_parameters_of(cfg, layer_type, where)
    rope_type = params.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise LoweringError(f"{where}: rope_type {rope_type!r} recomputes its frequencies from the sequence length; "
                            "it is not modelled (use 'default', 'linear', 'yarn' or 'llama3')")
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    inv, scaling = _rope_init(cfg, rope_type, theta, head_dim, keyed, family, ROPE_INIT_FUNCTIONS, where)
    default = RopeSpec.default_inv_freq(theta, head_dim)
    dim = 2 * len(inv)
    if dim > head_dim or dim % 2:
        raise LoweringError(f"{where}: the rotary module rotates {dim} dims of a {head_dim}-dim head")
    freqs = None if tuple(inv) == default else tuple(inv)
    return RopeSpec(theta=theta, inv_freq=freqs, scaling=float(scaling), dim=None if dim == head_dim else dim,
                    interleave=rope_interleaved(family))


def layer_rope_config(cfg, idx: int | None):
    """The config layer ``idx``'s rotation is built from: where ``config.layer_rope_theta`` sets each
    layer's theta (GraniteMoeSWA, whose model holds one rotary module per distinct non-zero theta in
    ``rotary_embs``), a copy whose rope_parameters carry that theta, as its model builds it; None for
    a theta of 0 (the model passes that layer no position embeddings: NoPE); else cfg itself."""
    thetas = getattr(cfg, "layer_rope_theta", None)
    if thetas is None or idx is None:
        return cfg
    theta = thetas[idx]
    if not theta:
        return None
    params = getattr(cfg, "rope_parameters", None) or {}
    if "rope_theta" not in params and "rope_type" not in params:
        raise LoweringError(f"layer {idx}: config.layer_rope_theta with rope_parameters keyed by layer type "
                            f"({sorted(params)}) is not modelled")
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.rope_parameters = {**params, "rope_theta": theta}
    return layer_cfg


def rope_parameters_of(cfg, layer_type: str, where: str) -> tuple[dict, str | None]:
    """(the rope parameters of a layer of type ``layer_type``, that type when they are keyed by
    layer type, else None)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if "rope_type" in params or "rope_theta" in params or not params:
        return params, None
    if layer_type not in params:
        raise LoweringError(f"{where}: config.rope_parameters is keyed by {sorted(params)}, not by this layer's "
                            f"type {layer_type!r}: its RoPE is not modelled")
    if not isinstance(params[layer_type], dict):
        raise LoweringError(f"{where}: config.rope_parameters[{layer_type!r}]={params[layer_type]!r}: a layer "
                            "type without rope parameters (its rotary module builds no frequencies) is not modelled")
    return params[layer_type], layer_type


def rotary_frequencies(rotary: nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention_scaling) the rotary module rotates layer type ``layer_type`` by: its
    ``inv_freq`` buffer, or per layer type ``<type>_inv_freq`` and ``<type>_attention_scaling``
    (its forward then takes the layer type); None when it holds neither."""
    if layer_type is None and isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))
    if layer_type is not None and isinstance(getattr(rotary, f"{layer_type}_inv_freq", None), torch.Tensor):
        return getattr(rotary, f"{layer_type}_inv_freq"), float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0))
    return None


def rope_interleaved(family: str | None) -> bool:
    """Whether the family's rotation pairs (2i, 2i+1) rather than (i, i + d/2), read from its modeling
    file: a rotate_half that slices ::2, or a rotation through complex numbers (view_as_complex)."""
    if family is None:
        return False
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    sources = []
    for fn_name in ("rotate_half", "apply_rotary_emb", "apply_rotary_pos_emb"):
        fn = getattr(mod, fn_name, None)
        if callable(fn):
            try:
                sources.append(inspect.getsource(inspect.unwrap(fn)))
            except (OSError, TypeError):
                pass
    text = "\n".join(sources)
    return "view_as_complex" in text or "::2]" in text


def _rope_init(cfg, rope_type: str, theta: float, head_dim: int, layer_type: str | None, family: str | None,
               functions, where: str) -> tuple[tuple[float, ...], float]:
    rotary_cls = rotary_class(family)
    if rotary_cls is not None:
        with torch.device("cpu"):
            rotary = rotary_cls(cfg)
        found = rotary_frequencies(rotary, layer_type)
        if found is None:
            held = sorted(n for n, _ in rotary.named_buffers())
            raise LoweringError(f"{where}: its family's rotary module {rotary_cls.__name__} holds no "
                                f"{'inv_freq' if layer_type is None else layer_type + '_inv_freq'} (its buffers: "
                                f"{', '.join(held) or 'none'}): its RoPE is not modelled")
        return tuple(found[0].float().tolist()), found[1]
    if layer_type is not None:
        raise LoweringError(f"{where}: per-layer-type rope parameters without the family's rotary module are not "
                            "modelled")
    if rope_type == "default":
        return RopeSpec.default_inv_freq(theta, head_dim), 1.0
    inv, scaling = functions[rope_type](cfg, "cpu")
    return tuple(inv.float().tolist()), float(scaling)


def rotary_class(family: str | None) -> type | None:
    """The family's own text rotary embedding (``*RotaryEmbedding`` in its modeling file)."""
    if family is None:
        return None
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = sorted(n for n in vars(mod) if n.endswith("RotaryEmbedding") and "Vision" not in n)
    return getattr(mod, names[0]) if names else None
