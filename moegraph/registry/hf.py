"""Hugging Face config.json files as registry models: ``load_model("path/to/config.json")``, and the
shipped entries of ``registry/hf/*.json`` (published configs, each with its ``_source``).

A config is read by the family it names (``model_type``, with transformers' own config class), so
every field keeps transformers' meaning; its decoder layers are built on the meta device (nothing
allocated) and lowered structurally (``moegraph.lowering.structural``). The ModelConfig's sizes come
from the lowered MoE layer itself; ``hf_config`` keeps the config's canonical JSON, from which
``moegraph.tracer.trace_model`` lowers the family's own layer rather than the reference one. A
family that does not compile is refused with the lowering's one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moegraph.canonical import canonical_json
from moegraph.registry.configs import ModelConfig
from moegraph.registry.fields import RegistryError

HF_DIR = Path(__file__).parent / "hf"
"""Shipped published configs: ``<name>.json``, the config.json values plus ``_source`` (its URL)."""


def hf_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in HF_DIR.glob("*.json")))


def read_hf_json(path: Path, shown: str) -> dict[str, Any]:
    """The config.json's mapping, without the ``_``-prefixed annotations (``_source``)."""
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise RegistryError(f"{shown}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise RegistryError(f"{shown}: not a text file ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise RegistryError(f"{shown}: invalid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise RegistryError(f"{shown}: not a Hugging Face config.json (no model_type)")
    return {k: v for k, v in data.items() if not k.startswith("_")}


def hf_text_config(data: dict[str, Any], shown: str):
    """transformers' config object of ``data`` (its text config for a multimodal family)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise RegistryError(f"{shown}: reading a Hugging Face config needs transformers (pip install "
                            "transformers)") from None
    from huggingface_hub.errors import StrictDataclassError
    known = True
    try:
        AutoConfig.for_model(data["model_type"])
    except ValueError:
        known = False
    try:
        cfg = AutoConfig.for_model(data["model_type"], **{k: v for k, v in data.items() if k != "model_type"})
    except (ValueError, TypeError, StrictDataclassError) as err:   # the config class's validators
        what = (f"the {data['model_type']} config refuses its values" if known else
                f"model_type {data['model_type']!r} is not a family the installed transformers knows")
        raise RegistryError(f"{shown}: {what} ({' '.join(str(err).split())[:160]})") from None
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def hf_model_layers(data: dict[str, Any], shown: str):
    """The family's decoder layers built on the meta device from ``data`` (a list)."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING
    cfg = hf_text_config(data, shown)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None) or _family_causal_lm(cfg)
    if model_cls is None:
        raise RegistryError(f"{shown}: transformers has no causal LM for model_type {data['model_type']!r}")
    from moegraph.lowering.hf_common import names_of
    try:
        with torch.device("meta"):
            model = model_cls(cfg)
    except Exception as err:  # noqa: BLE001 - the family's own constructor on values its config accepted
        raise RegistryError(f"{shown}: {model_cls.__name__} cannot be built from it{_culprit(data, cfg, err)} "
                            f"({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None
    names = names_of(model)                              # DBRX: transformer.blocks
    base = getattr(model, names.base, model)
    return cfg, list(getattr(base, names.layers))


def _culprit(data: dict[str, Any], cfg, err: Exception) -> str:
    """', at field=value' for the config field the error points at, or '' when it cannot tell: the one
    field whose value the message quotes (a KeyError's unknown activation name; of several, the one
    negative number), or, for an operation on None, the one field set to None where the family's
    default is a number."""
    import re
    text = str(err)
    quoted = [k for k, v in data.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)
              and re.search(rf"(?<![\w.]){re.escape(str(v))}(?![\w.])", text)]
    negative = [k for k in quoted if isinstance(data[k], (int, float)) and data[k] < 0]
    found = quoted if len(quoted) == 1 else negative
    if not found and "NoneType" in text:
        defaults = type(cfg)().to_dict()
        defaults |= {k: v for nested in list(defaults.values()) if isinstance(nested, dict) for k, v in nested.items()
                     if k not in defaults}                # rope_theta lives in rope_parameters
        found = [k for k, v in data.items() if v is None and isinstance(defaults.get(k), (int, float))
                 and not isinstance(defaults.get(k), bool)]
    return f", at {found[0]}={data[found[0]]!r}" if len(found) == 1 else ""


def _family_causal_lm(cfg) -> type | None:
    """The ``<X>ForCausalLM`` of the config's own family module taking exactly this config class,
    where transformers' auto mapping has none for it (Mistral 4's text model); None if it has none."""
    import importlib
    import inspect
    family = type(cfg).__module__.split(".")
    if len(family) < 3 or family[:2] != ["transformers", "models"]:
        return None
    try:
        mod = importlib.import_module(f"transformers.models.{family[2]}.modeling_{family[2]}")
    except ImportError:
        return None
    found = [c for name, c in vars(mod).items() if name.endswith("ForCausalLM") and inspect.isclass(c)
             and getattr(c, "config_class", None) is type(cfg)]
    return found[0] if len(found) == 1 else None


def moe_layer(layers: list, shown: str):
    """(index, layer, program) of the first decoder layer with an MoE block that lowers."""
    from moegraph.lowering import LoweringError
    from moegraph.lowering.specs import MoESpec
    from moegraph.tracer import extract_program
    first_error = None
    for i, layer in enumerate(layers):
        try:
            program = extract_program(layer)
        except LoweringError as err:
            first_error = first_error or f"layer {i}: {err}"
            continue
        if program.specs(MoESpec):
            return i, layer, program
    raise RegistryError(f"{shown}: no MoE decoder layer lowers ({first_error or 'every layer is dense'})")


def load_hf_config(path: Path, shown: str, name: str) -> ModelConfig:
    """A ModelConfig named ``name`` from a Hugging Face config.json (module docstring)."""
    from moegraph.lowering.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec
    data = read_hf_json(path, shown)
    cfg, layers = hf_model_layers(data, shown)
    index, _, program = moe_layer(layers, shown)
    (moe,) = program.specs(MoESpec)
    attn = next(iter(program.specs(AttentionSpec) + program.specs(MLASpec)), None) or _softmax_attention(layers, shown)
    dense = _leading_dense(layers[:index], shown)
    fields: dict[str, Any] = dict(
        name=name, layers=len(layers), hidden=moe.hidden, experts=moe.experts, top_k=moe.top_k,
        ffn_hidden=moe.ffn_hidden, rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-5) or 1e-5),
        normalize_topk=moe.normalize, hf_config=canonical_json(data))
    if isinstance(attn, MLASpec):
        fields |= dict(heads=attn.heads, kv_heads=attn.heads, q_lora_rank=attn.q_rank, kv_lora_rank=attn.kv_rank,
                       qk_nope_head_dim=attn.nope_dim, qk_rope_head_dim=attn.rope_dim, v_head_dim=attn.v_dim,
                       rope_theta=attn.rope_theta)
    else:
        fields |= dict(heads=attn.heads, kv_heads=attn.kv_heads, head_dim=attn.head_dim,
                       qkv_bias=attn.qkv_bias is not None, rope_theta=attn.rope_theta or 1e6,
                       qk_norm=attn.q_norm is not None and not attn.qk_norm_per_head)
    if moe.shared is not None:
        fields |= dict(shared_experts=1, shared_ffn_hidden=moe.shared.ffn_hidden, shared_gate=moe.shared.gate is not None)
    if moe.scoring == "sigmoid" and moe.group_score == "top2-sum" and moe.router_bias is None:
        fields |= dict(router_scoring="sigmoid", n_group=moe.groups, topk_group=moe.topk_groups,
                       routed_scaling_factor=moe.scale, score_correction_bias=moe.score_bias is not None)
    if dense:
        fields |= dict(first_k_dense_replace=len(dense), dense_ffn_hidden=dense[0].ffn_hidden)
    try:
        return ModelConfig(**fields)
    except RegistryError as err:
        raise RegistryError(f"{shown}: {err}", field=err.field) from None


def _softmax_attention(layers: list, shown: str):
    """The first layer's softmax attention spec (GQA or latent), for a model whose first MoE layer mixes
    its tokens otherwise (Qwen3-Next's linear attention: its heads are the full-attention layers')."""
    from moegraph.lowering.specs import AttentionSpec, MLASpec
    from moegraph.tracer import extract_program
    for layer in layers:
        program = extract_program(layer)
        found = program.specs(AttentionSpec) + program.specs(MLASpec)
        if found:
            return found[0]
    raise RegistryError(f"{shown}: no layer has a softmax attention (GQA or latent) whose heads a model config "
                        "describes")


def _leading_dense(layers: list, shown: str) -> list:
    """The dense MLP specs of the layers before the first MoE layer that lowers (DeepSeek's
    first_k_dense_replace); a layer among them that does not lower (Jamba's Mamba layers, or an MoE
    layer of a kind moegraph refuses) is refused naming the file and the layer, not called dense."""
    from moegraph.lowering import LoweringError
    from moegraph.lowering.specs import MLPSpec
    from moegraph.tracer import extract_program
    specs = []
    for i, layer in enumerate(layers):
        try:
            specs += extract_program(layer).specs(MLPSpec)
        except LoweringError as err:
            raise RegistryError(f"{shown}: layer {i} does not lower ({err}); it comes before layer {len(layers)}, "
                                "the first whose MoE block lowers") from None
    return specs


def hf_layer(cfg: ModelConfig):
    """The family's own MoE decoder layer of a ModelConfig read from a config.json (meta device)."""
    return hf_stack(cfg, 1)[0]


def hf_stack(cfg: ModelConfig, layers: int) -> list:
    """The family's own decoder layers (meta device) a stack of ``layers`` holds: all of them when
    ``layers`` is the model's layer count (``ModelConfig.all_layers``: GPT-OSS's alternating
    attention, DeepSeek's dense first layers, Llama 4's NoPE and dense layers, each kind lowered
    once), else ``layers`` consecutive ones from the first MoE layer on (one: that layer)."""
    data = json.loads(cfg.hf_config)
    _, found = hf_model_layers(data, cfg.name)
    if layers == len(found):
        return found
    start = moe_layer(found, cfg.name)[0]
    if not 1 <= layers <= len(found) - start:
        raise RegistryError(f"layers={layers} must be between 1 and {cfg.layers_phrase()}")
    return found[start:start + layers]


__all__ = ["HF_DIR", "hf_layer", "hf_names", "hf_stack", "load_hf_config"]
