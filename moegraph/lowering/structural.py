"""Structural lowering: a decoder layer's parts recognised by what they hold, not by their class.

A module is read as one block kind by its submodules and parameters alone:
    norm       no children, a 1-D ``weight`` (and ``bias``: a LayerNorm), an epsilon attribute
    attention  ``o_proj`` and ``q_proj``/``k_proj``/``v_proj`` (GQA), a fused ``Wqkv`` and ``out_proj``
               (DBRX), or the latent projections ``kv_a_proj_with_mqa``/``kv_b_proj`` (MLA);
               read by ``moegraph.lowering.structural_attention``
    moe        an ``experts`` child (fused 3-D weights or a ModuleList of MLPs) and a router child
               (``gate`` or ``router``) holding a weight [E, h]
    mlp        ``gate_proj``/``up_proj``/``down_proj`` linears
    linear_attention  Gated DeltaNet: ``in_proj_qkvz``, ``in_proj_ba`` (Qwen3-Next) or ``in_proj_qkv``,
               ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5-MoE), ``conv1d``, ``norm``, ``out_proj``,
               ``A_log``, ``dt_bias``; or Kimi Delta Attention (``KDA_CHILDREN``; checked before
               attention: it holds ``q_proj``/``k_proj``/``v_proj``/``o_proj`` too); read by
               ``moegraph.lowering.structural_linear``
Sizes come from parameter shapes; behaviour (top-k, normalisation, windows, RoPE frequencies) from
the attributes and configuration fields with transformers' usual names, and from the family's row
in ``moegraph.lowering.families`` where a name alone cannot tell. Which attributes a class's forward
reads is read from its source (``forward_reads``), so a child the forward never uses is left out
(the coverage check then names its parameters).

Never silently wrong by construction: every compile runs each lowered layer against its eager
module (``moegraph.lowering.check``). The structural guard (on by default; ``structural_guard``)
also refuses, before any lowering, what a structural reading is known not to describe: a subclass
of a transformers class overriding a method, a child of a recognised block that its forward does not
read, a module of a non-transformers class (its math is unknown; register a rule for it).

Notation: h hidden, H query heads, G kv heads, d head dim, E experts, f expert h_ffn.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass

from torch import nn

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError, Rule
from moegraph.lowering.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec

_GUARD: contextvars.ContextVar[bool] = contextvars.ContextVar("moegraph_structural_guard", default=True)
_LAYER: contextvars.ContextVar["LayerContext | None"] = contextvars.ContextVar("moegraph_layer", default=None)

ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
NORM_KINDS = ("norm", "attention", "mla", "moe", "mlp")


@contextlib.contextmanager
def structural_guard(on: bool):
    """Switch the structural guard on or off inside the block (tests of the numerical check
    switch it off, so that only the numbers can refuse a near-miss module)."""
    token = _GUARD.set(bool(on))
    try:
        yield
    finally:
        _GUARD.reset(token)


def guard_on() -> bool:
    return _GUARD.get()


@dataclass(frozen=True)
class LayerContext:
    """What every block of one decoder layer shares: its configuration (``config`` of any
    submodule), layer index, and the family (transformers folder) of its class."""

    config: object | None
    layer_idx: int | None
    family: str | None


@contextlib.contextmanager
def layer_context(layer: nn.Module):
    """The LayerContext of ``layer`` for the rules called while it is lowered."""
    config = next((m.config for m in layer.modules() if _is_config(getattr(m, "config", None))), None)
    idx = next((m.layer_idx for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)), None)
    token = _LAYER.set(LayerContext(config, idx, family_of(type(layer))))
    try:
        yield
    finally:
        _LAYER.reset(token)


def _is_config(obj) -> bool:
    return obj is not None and hasattr(obj, "to_dict") and hasattr(obj, "hidden_size")


def _ctx() -> LayerContext:
    return _LAYER.get() or LayerContext(None, None, None)


TRANSFORMERS_SUPPORTED = ((5, 17), (6, 0))
"""The transformers versions [low, high) whose models this lowering reads and checks: 5.17 (the GPU
image's, checked there) to 5.x (CI installs the newest 5.x: 5.24 on 2026-11-27). pyproject.toml's
``hf`` and ``test`` extras say the same (tests/test_numerical_check.py holds them together)."""


def transformers_range() -> str:
    """TRANSFORMERS_SUPPORTED as a pip requirement: '>=5.17,<6.0'."""
    (a, b), (c, d) = TRANSFORMERS_SUPPORTED
    return f">={a}.{b},<{c}.{d}"


def installed_transformers() -> str:
    """The imported transformers' version."""
    import transformers
    return transformers.__version__


def require_supported_transformers(version: str | None = None) -> None:
    """One LoweringError naming the installed transformers version and the supported range when
    it is outside TRANSFORMERS_SUPPORTED (``version``: the installed one unless given), before any
    of its modules is read: an older or newer library lays its models out and calls its layers
    differently, which would fail deep in the lowering or its numerical check."""
    if version is None:
        version = installed_transformers()
    m = re.match(r"(\d+)\.(\d+)", version)
    low, high = TRANSFORMERS_SUPPORTED
    if m is None or not low <= (int(m.group(1)), int(m.group(2))) < high:
        raise LoweringError(f"transformers {version} is not supported: moegraph lowers transformers models with "
                            f"transformers{transformers_range()} (pip install 'transformers{transformers_range()}')")


def family_of(cls: type) -> str | None:
    """'qwen3_moe' for a class of transformers.models.qwen3_moe.modeling_qwen3_moe, else None."""
    parts = cls.__module__.split(".")
    if len(parts) >= 4 and parts[:2] == ["transformers", "models"] and parts[3].startswith("modeling_"):
        return parts[2]
    return None


def _library_base(cls: type) -> type | None:
    """The first class in cls's MRO defined in a transformers model file (cls itself, or the
    transformers class a user subclassed)."""
    return next((c for c in cls.__mro__ if family_of(c) is not None), None)


# -- what a forward reads -------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def forward_reads(cls: type) -> frozenset[str]:
    """Names ``self.X`` read by cls.forward and by the methods it calls on self (transitively).
    Read from the source (AST), so a child the forward never touches does not count as used."""
    seen, reads, todo = set(), set(), ["forward"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fn = getattr(cls, name, None)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                reads.add(node.attr)
                if callable(getattr(cls, node.attr, None)) and not isinstance(getattr(cls, node.attr, None), type):
                    todo.append(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
                  and isinstance(node.args[1], ast.Constant)):
                reads.add(str(node.args[1].value))
    return frozenset(reads)


@functools.lru_cache(maxsize=None)
def returns_tuple(cls: type) -> bool:
    """Whether cls.forward returns a tuple literal (``return out, logits``): the tracer then hands
    the layer a real tuple to unpack."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple) for n in ast.walk(tree))


# -- classification --------------------------------------------------------------------------------

def classify(module: nn.Module) -> str | None:
    """The block kind ``module`` has the structure of (module docstring), or None."""
    children = dict(module.named_children())
    own = dict(module.named_parameters(recurse=False))
    if not children and "weight" in own and own["weight"].dim() == 1 and _eps(module) is not None:
        return "norm"
    if is_linear_attention(children, own):                  # Gated DeltaNet (Qwen3-Next), Kimi Delta Attention
        return "linear_attention"
    if "o_proj" in children and "kv_b_proj" in children and "kv_a_proj_with_mqa" in children:
        return "mla"
    if "o_proj" in children and all(p in children for p in ("q_proj", "k_proj", "v_proj")):
        return "attention"
    if "o_proj" in children and "q_proj" in children and (   # Gemma 4: values from k_proj, or a kv-shared layer
            ("k_proj" in children and getattr(module, "use_alternative_attention", False))
            or getattr(module, "is_kv_shared_layer", False)):
        return "attention"
    if "experts" not in children and _layer_router(module):
        return "router"
    if _layer_experts(module):
        return "experts"
    if all(isinstance(children.get(p), nn.Linear) for p in FUSED_ATTENTION):
        return "attention"
    if "experts" in children and _router_name(module) is not None:
        return "moe"
    if all(isinstance(children.get(p), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")) or \
            all(isinstance(children.get(p), nn.Linear) for p in ("gate_up_proj", "down_proj")):   # MiniMax-M3's
        return "mlp"
    return None


def _layer_router(module: nn.Module) -> bool:
    """A router that is its decoder layer's own child (Gemma 4's): a linear ``proj`` [E, h] and, besides,
    at most its own norm (no parameters) and 1-D parameters (``scale``, ``per_expert_scale``)."""
    proj = module._modules.get("proj")
    others = [n for n in module._modules if n not in ("proj", "norm")]
    return (isinstance(proj, nn.Linear) and not others and "per_expert_scale" in module._parameters
            and all(p.dim() == 1 for p in module._parameters.values()))


def _layer_experts(module: nn.Module) -> bool:
    """Routed experts that are their decoder layer's own child (Gemma 4's): fused 3-D gate_up_proj and
    down_proj parameters, an activation and no other child."""
    own = module._parameters
    return (set(own) == {"gate_up_proj", "down_proj"} and own["gate_up_proj"].dim() == 3
            and set(module._modules) <= {"act_fn"})


def _eps(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    return None


def _router_name(module: nn.Module) -> str | None:
    # parameters read from _parameters: during torch.fx tracing, getattr returns proxies for them
    for name in ROUTER_NAMES:
        child = module._modules.get(name)
        w = _router_weight(child)[1] if isinstance(child, nn.Module) else None
        if w is not None and w.dim() == 2:
            return name
    return None


ROUTER_LINEARS = ("wg", "gate", "layer")   # the router's own linear: HunYuan's gate.wg, AFMoE's router.gate, DBRX's router.layer


def _router_weight(router: nn.Module) -> tuple[str | None, nn.Parameter | None]:
    """(path below the router, weight [E, h]) of a router child; (None, None) when it has none."""
    if router._parameters.get("weight") is not None:
        return "weight", router._parameters["weight"]
    for name in ROUTER_LINEARS:
        if isinstance(router._modules.get(name), nn.Linear):
            return f"{name}.weight", router._modules[name]._parameters["weight"]
    return None, None


def structural_rule(module: nn.Module, qualname: str) -> Rule | None:
    """A Rule lowering ``module`` by its structure, or None when it has none of the block
    structures. With the guard on, a structure on a class this lowering does not know raises."""
    kind = classify(module)
    if kind is None:
        return None
    cls = type(module)
    base = _library_base(cls)
    if guard_on() and type(module) is not nn.LayerNorm:       # torch's own LayerNorm: its math is known
        if base is None:
            return None          # not a transformers class: only a registered rule may describe it
        _check_overrides(cls, base, qualname)
    return Rule(cls, _read_failures(kind, _BUILDERS[kind]))


def _read_failures(kind: str, build):
    """``build`` with a failure to read the module's structure (an attribute it lacks, a shape that
    does not fit) turned into one LoweringError line naming the module: a refusal, not a traceback."""
    def rule(module: nn.Module, qualname: str):
        try:
            return build(module, qualname)
        except LoweringError:
            raise
        except (AttributeError, TypeError, KeyError, IndexError, ValueError, ZeroDivisionError) as err:
            raise LoweringError(f"{qualname or 'the layer'} ({type(module).__name__}): its {kind} structure is not the "
                                f"one modelled ({type(err).__name__}: {err})") from None
    return rule


def _check_overrides(cls: type, base: type, qualname: str) -> None:
    """A user subclass of a transformers class overriding a method: its math is not the family's."""
    if cls is base:
        return
    own = [name for c in cls.__mro__[:cls.__mro__.index(base)] for name, v in vars(c).items()
           if callable(v) and not name.startswith("__") and hasattr(base, name)]
    if "forward" in {n for c in cls.__mro__[:cls.__mro__.index(base)] for n in vars(c)}:
        own = ["forward", *[o for o in own if o != "forward"]]
    if own:
        where = repr(qualname) if qualname else "the layer"
        raise LoweringError(f"{where} ({cls.__module__}.{cls.__name__}) subclasses {base.__name__} but overrides "
                            f"{', '.join(dict.fromkeys(own))}: the structural lowering reads {base.__name__}'s own "
                            f"forward; register a rule for {cls.__name__}")


def check_children(module: nn.Module, qualname: str, known: set[str]) -> None:
    """Guard: every child of a recognised block must be one its lowering reads (``known``) or one
    its forward never touches (then its parameters are named by the coverage check)."""
    if not guard_on():
        return
    reads = forward_reads(type(module))
    for name, child in module.named_children():
        if name in reads and name not in known:
            raise LoweringError(f"{_join(qualname, name)!r} ({type(child).__name__}): {type(module).__name__}'s "
                                f"forward uses it, but the structural lowering of a {classify(module)} block does not "
                                "model it")


def _join(qualname: str, name: str) -> str:
    return f"{qualname}.{name}" if qualname else name


def _src(qualname: str, name: str) -> ParamSource:
    return ParamSource(_join(qualname, name))


def _child_class_check(module: nn.Module, qualname: str, name: str) -> nn.Module:
    """A child a block's lowering reads; with the guard on it must be a plain nn.Linear or a
    transformers class whose methods it did not override."""
    child = getattr(module, name)
    if not guard_on() or type(child) is nn.Linear:
        return child
    base = _library_base(type(child))
    if base is None:
        raise LoweringError(f"{_join(qualname, name)!r} ({type(child).__name__}): the structural lowering of "
                            f"{type(module).__name__} reads it as its {name}, but it is not a transformers class; "
                            "register a rule that describes it")
    _check_overrides(type(child), base, _join(qualname, name))
    return child


# -- norms -----------------------------------------------------------------------------------------

def norm_spec(module: nn.Module, qualname: str) -> NormSpec:
    """An RMSNorm: weight * x rsqrt(mean(x^2) + eps); a bias makes it a LayerNorm (mean removed, then
    + bias), recognised by its forward reading ``bias`` or by torch's nn.LayerNorm; so does a forward
    that removes the mean, found by running it (Cohere's bias-free LayerNorm)."""
    eps = _eps(module)
    bias = getattr(module, "bias", None)
    if isinstance(module, nn.LayerNorm) or (bias is not None and "bias" in forward_reads(type(module))) or \
            _removes_mean(module, eps):
        return NormSpec(_src(qualname, "weight"), eps, kind="layer",
                        bias=None if bias is None else _src(qualname, "bias"))
    return NormSpec(_src(qualname, "weight"), eps, offset=_scale_offset(module, eps))


def _run_norm(module: nn.Module):
    """(x, weight, output) in fp32 of ``module`` on 8 random rows of mean 1, or None where it cannot
    run alone. A norm on the meta device (a config's layers, built to be priced) runs as a CPU copy
    with random weights: what it computes comes from its code, not its values."""
    import copy

    import torch
    gen = torch.Generator().manual_seed(7)
    if module._parameters["weight"].is_meta:
        module = copy.deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            for q in module.parameters():
                q.copy_(torch.randn(q.shape, generator=gen) * 0.2)
    w = module._parameters["weight"]
    x = (torch.randn(8, w.shape[0], generator=gen) + 1).to(w.dtype).to(w.device)
    try:
        with torch.no_grad():
            got = module(x).float()
    except Exception:  # noqa: BLE001 - a norm that cannot run alone: read plainly, checked by numbers
        return None
    return x.float(), w.detach().float(), got


def _close(got, want) -> bool:
    import torch
    return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()) + 1e-6))


def _scale_offset(module: nn.Module, eps: float) -> float:
    """1.0 where an RMSNorm scales by 1 + weight (Gemma's, MiniMax-M3's: its output is
    x rsqrt(mean(x^2) + eps) * (1 + weight) and not * weight, ``_run_norm``), else 0; one that
    cannot run reads as 0, and the numerical check has the last word."""
    import torch
    run = _run_norm(module)
    if run is None:
        return 0.0
    x, w, got = run
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return 1.0 if _close(got, normed * (1 + w)) and not _close(got, normed * w) else 0.0


def weightless_rms_eps(module: nn.Module) -> float | None:
    """The eps of a norm holding no parameters that computes x rsqrt(mean(x^2) + eps) over its last dim
    (Gemma 4's ``with_scale=False`` RMSNorms: its router's and value norms), found by running it on 8
    random rows; None when it is not one (or cannot run alone)."""
    import torch
    eps = _eps(module)
    if eps is None or next(module.parameters(), None) is not None or next(module.buffers(), None) is not None:
        return None
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7)) + 1
    try:
        with torch.no_grad():
            got = module(x).float()
    except Exception:  # noqa: BLE001 - a norm that cannot run alone: not read as one
        return None
    return eps if _close(got, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) else None


def _removes_mean(module: nn.Module, eps: float) -> bool:
    """Whether a bias-free norm centres its rows: its output (``_run_norm``) is F.layer_norm's
    (weight, no bias) and not an RMSNorm's. False when it cannot run (then it is read as an
    RMSNorm, and the numerical check, which runs on real weights, has the last word)."""
    import torch.nn.functional as F
    if "bias" in module._parameters:
        return False
    run = _run_norm(module)
    if run is None:
        return False
    x, w, got = run
    return _close(got, F.layer_norm(x, (w.shape[0],), w, None, eps))


# -- attention -------------------------------------------------------------------------------------

def _layer_type(cfg, idx: int | None) -> str:
    types = getattr(cfg, "layer_types", None)
    if types and idx is not None and idx < len(types):
        return types[idx]
    return "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"


def mask_of(cfg, idx: int | None) -> tuple[int | None, int | None]:
    """(window, chunk) of layer ``idx``'s attention mask, as transformers' models build it: the
    layer type (config.layer_types, or sliding wherever config.sliding_window is set) picks
    create_causal_mask, create_sliding_window_causal_mask (keys in (q - window, q]) or
    create_chunked_causal_mask (keys in q's chunk of attention_chunk_size)."""
    kind = _layer_type(cfg, idx)
    if kind == "full_attention":
        return None, None
    if kind == "sliding_attention":
        if not getattr(cfg, "sliding_window", None):
            return None, None              # a sliding layer without a window: transformers masks it fully causal
        return int(cfg.sliding_window), None
    if kind == "chunked_attention":
        return None, int(cfg.attention_chunk_size)
    raise LoweringError(f"layer {idx}: {kind.replace('_', ' ')} (config.layer_types[{idx}]={kind!r}) is not modelled")


LINEAR_ATTENTION = ("conv1d", "norm", "out_proj")
"""The children of a Gated DeltaNet block besides its projections (LINEAR_PROJECTIONS), with its
parameters DECAY_PARAMS (Qwen3-Next, Qwen3.5-MoE)."""
LINEAR_PROJECTIONS = {"grouped": ("in_proj_qkvz", "in_proj_ba"), "flat": ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                          "in_proj_a")}
DECAY_PARAMS = ("A_log", "dt_bias")


KDA_CHILDREN = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
                "o_proj")
"""Kimi Delta Attention's children (Kimi Linear; layout 'kda'): its decay's A_log and dt_bias are the
forget gate's, beside its low-rank projection (f_a_proj, f_b_proj)."""


def linear_layout(children: dict) -> str | None:
    """'grouped' (Qwen3-Next) or 'flat' (Qwen3.5-MoE): which projections a Gated DeltaNet holds; 'kda':
    Kimi Delta Attention's (KDA_CHILDREN)."""
    if all(n in children for n in KDA_CHILDREN):
        return "kda"
    return next((k for k, names in LINEAR_PROJECTIONS.items() if all(n in children for n in names)), None)


def is_linear_attention(children: dict, own: dict) -> bool:
    layout = linear_layout(children)
    return layout == "kda" or (layout is not None and all(n in children for n in LINEAR_ATTENTION)
                               and all(p in own for p in DECAY_PARAMS))


FUSED_ATTENTION = ("Wqkv", "out_proj")
"""A fused q/k/v projection and its output projection (DBRX): rows q [H*d], k [G*d], v [G*d]."""
def _attention(module: nn.Module, qualname: str) -> AttentionSpec:
    from moegraph.lowering.structural_attention import attention_spec
    return attention_spec(module, qualname)


def _mla(module: nn.Module, qualname: str) -> MLASpec:
    from moegraph.lowering.structural_attention import mla_spec
    return mla_spec(module, qualname)


def _moe(module: nn.Module, qualname: str) -> MoESpec:
    from moegraph.lowering.structural_ffn import moe_spec
    return moe_spec(module, qualname)


def _mlp(module: nn.Module, qualname: str) -> MLPSpec:
    from moegraph.lowering.structural_ffn import mlp_spec
    return mlp_spec(module, qualname)


def _linear_attention(module: nn.Module, qualname: str):
    from moegraph.lowering.structural_linear import linear_attention_spec
    return linear_attention_spec(module, qualname)


def _router(module: nn.Module, qualname: str):
    from moegraph.lowering.parallel_ffn import router_spec
    return router_spec(module, qualname)


def _experts(module: nn.Module, qualname: str):
    from moegraph.lowering.parallel_ffn import experts_spec
    return experts_spec(module, qualname)


_BUILDERS = {"norm": norm_spec, "attention": _attention, "mla": _mla, "moe": _moe, "mlp": _mlp,
             "linear_attention": _linear_attention, "router": _router, "experts": _experts}
