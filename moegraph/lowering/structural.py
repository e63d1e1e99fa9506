"""Structural lowering: a decoder layer's parts recognised by what they hold, not by their class.

A module is read as one block kind by its submodules and parameters alone:
    norm       no children, a 1-D ``weight`` (and ``bias``: a LayerNorm), an epsilon attribute
    attention  ``o_proj`` and ``q_proj``/``k_proj``/``v_proj`` (GQA), or the latent projections
               ``kv_a_proj_with_mqa``/``kv_b_proj`` (MLA)
    moe        an ``experts`` child (fused 3-D weights or a ModuleList of MLPs) and a router child
               (``gate`` or ``router``) holding a weight [E, h]
    mlp        ``gate_proj``/``up_proj``/``down_proj`` linears
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
from moegraph.lowering.rope import layer_rope_config, rope_of
from moegraph.lowering.specs import AttentionSpec, MLASpec, MLPSpec, MoESpec, NormSpec, OutGateSpec, RopeSpec

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
    if "o_proj" in children and "kv_b_proj" in children and "kv_a_proj_with_mqa" in children:
        return "mla"
    if "o_proj" in children and all(p in children for p in ("q_proj", "k_proj", "v_proj")):
        return "attention"
    if all(isinstance(children.get(p), nn.Linear) for p in FUSED_ATTENTION):
        return "attention"
    if "experts" in children and _router_name(module) is not None:
        return "moe"
    if all(isinstance(children.get(p), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
        return "mlp"
    return None


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
    return NormSpec(_src(qualname, "weight"), eps)


def _removes_mean(module: nn.Module, eps: float) -> bool:
    """Whether a bias-free norm centres its rows: its output on 8 random rows (mean 1) is F.layer_norm's
    (weight, no bias) and not an RMSNorm's. False when it cannot run (meta weights: then it is read as
    an RMSNorm, and the numerical check, which runs on real weights, has the last word)."""
    import torch
    import torch.nn.functional as F
    w = module._parameters["weight"]
    if w.is_meta or "bias" in module._parameters:
        return False
    x = (torch.randn(8, w.shape[0], generator=torch.Generator().manual_seed(7)) + 1).to(w.dtype).to(w.device)
    try:
        with torch.no_grad():
            got = module(x).float()
    except Exception:  # noqa: BLE001 - a norm that cannot run alone: read as RMSNorm, checked by numbers
        return False
    want = F.layer_norm(x.float(), (w.shape[0],), w.detach().float(), None, eps)
    return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())))


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


FUSED_ATTENTION = ("Wqkv", "out_proj")
"""A fused q/k/v projection and its output projection (DBRX): rows q [H*d], k [G*d], v [G*d]."""
QK_NORM_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"), ("qk_norm", "qk_norm"))
OUT_GATE_NAMES = ("g_proj", "gate_proj")      # Laguna, AFMoE: the attention output's gate projection


def _used_after_rope(cls: type, attr: str) -> bool:
    """Whether cls.forward first uses self.<attr> after its first call of a rotary function (a
    callee whose name mentions rotary or rope): read from the source's line order."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return False
    use = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == attr
           and isinstance(n.value, ast.Name) and n.value.id == "self"]
    rope = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and any(w in ast.unparse(n.func).lower() for w in ("rotary", "rope"))]
    return bool(use and rope) and min(use) > min(rope)


def rope_applied(module: nn.Module) -> bool:
    """Whether this attention module rotates q and k: its forward's rotary call, when it sits under
    ``if <test>`` reading only self's attributes (Llama 4's ``self.use_rope``, Cohere2's
    ``self.sliding_window is not None or self.force_rope``), runs iff the test holds for this module."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward))))
    except (OSError, TypeError, SyntaxError):
        return True
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        rotates = any(isinstance(n, ast.Call) and any(w in ast.unparse(n.func).lower() for w in ("rotary", "rope"))
                      for stmt in node.body for n in ast.walk(stmt))
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if rotates and names <= {"self", "None", "True", "False"}:
            try:
                return bool(eval(compile(ast.Expression(node.test), "<rope test>", "eval"), {}, {"self": module}))
            except Exception:  # noqa: BLE001 - an unreadable test: assume the rotation runs; the check decides
                return True
    return True


QUERY_SCALE_ARG = "attention_scaling"   # a query scale per position, computed by the model (Beam)


def attention_spec(module: nn.Module, qualname: str) -> AttentionSpec:
    """GQA attention read from q/k/v/o_proj's shapes (or a fused Wqkv's) and the config (module docstring)."""
    from moegraph.lowering.hf_common import check_attention
    ctx = _ctx()
    cfg = getattr(module, "config", None) or ctx.config
    reads = forward_reads(type(module))
    d = int(getattr(module, "head_dim", 0) or getattr(cfg, "head_dim", 0) or 0)
    if not d:
        raise LoweringError(f"{qualname} ({type(module).__name__}): no head_dim attribute")
    if "q_proj" not in module._modules:
        return _fused_attention_spec(module, qualname, d)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        _child_class_check(module, qualname, name)
    H, G = module.q_proj.out_features // d, module.k_proj.out_features // d
    dv = module.v_proj.out_features // G                 # the value heads' width (MiMo-V2-Flash: not d)
    if module.v_proj.out_features != G * dv or module.o_proj.in_features != H * dv:
        raise LoweringError(f"{qualname} ({type(module).__name__}): v_proj gives {module.v_proj.out_features} and "
                            f"o_proj takes {module.o_proj.in_features} features: not {G} and {H} value heads of one "
                            "width")
    v_scale = getattr(module, "v_scale", 1.0)
    if isinstance(v_scale, bool) or not isinstance(v_scale, (int, float)):
        raise LoweringError(f"{qualname}.v_scale={v_scale!r}: only a constant value scale is modelled")
    check_attention(module, qualname, head_dim=d, structural=True)
    if QUERY_SCALE_ARG in inspect.signature(type(module).forward).parameters:
        raise LoweringError(f"{qualname} ({type(module).__name__}): its forward multiplies the queries by a "
                            f"position-dependent {QUERY_SCALE_ARG} its model passes (Beam's NoPE layers' scalable "
                            "softmax, (1 + (p + 1)/2048)^0.1): not modelled")
    rope, use_rope, window, chunk, temperature_floor = _position_settings(module, qualname, cfg, d)
    biases = [getattr(module, n).bias for n in ("q_proj", "k_proj", "v_proj")]
    qkv_bias = tuple(_src(qualname, f"{n}.bias") for n in ("q_proj", "k_proj", "v_proj")) \
        if all(b is not None for b in biases) else None
    o_bias = _src(qualname, "o_proj.bias") if module.o_proj.bias is not None else None
    q_norm = k_norm = l2 = None
    per_head = after = False
    known = {"q_proj", "k_proj", "v_proj", "o_proj"}
    names = next(((qn, kn) for qn, kn in QK_NORM_NAMES if {qn, kn} <= reads
                  and module._modules.get(qn) is not None), None)
    if names is not None:
        qn, kn = names
        known |= {qn, kn}
        after = _used_after_rope(type(module), qn)
        qmod, kmod = _child_class_check(module, qualname, qn), _child_class_check(module, qualname, kn)
        if "weight" not in qmod._parameters and qn == kn and _eps(qmod) is not None:
            l2, per_head = _eps(qmod), True                    # Llama 4: a weightless L2 norm of each head
        else:
            q_norm, k_norm = norm_spec(qmod, f"{qualname}.{qn}"), norm_spec(kmod, f"{qualname}.{kn}")
            widths = (qmod.weight.shape[0], kmod.weight.shape[0])
            if widths == (d, d):
                per_head = True
            elif widths != (H * d, G * d) or after:
                raise LoweringError(f"{qualname}: {qn}/{kn} normalise {widths} features: neither each head's {d} "
                                    f"nor the projections' {H * d} and {G * d} before RoPE")
    gate_name, out_gate = _out_gate(module, qualname, reads, H, dv)
    known.add(gate_name)
    check_children(module, qualname, known)
    sinks = _src(qualname, "sinks") if getattr(module, "sinks", None) is not None and "sinks" in reads else None
    scale = float(module.scaling)
    return AttentionSpec(q=_src(qualname, "q_proj.weight"), k=_src(qualname, "k_proj.weight"),
                         v=_src(qualname, "v_proj.weight"), o=_src(qualname, "o_proj.weight"), heads=H, kv_heads=G,
                         head_dim=d, rope_theta=rope.theta if rope is not None else 0.0, use_rope=use_rope,
                         tuple_output=returns_tuple(type(module)), qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
                         qk_norm_per_head=per_head, qk_norm_after_rope=after, qk_l2_eps=l2, o_bias=o_bias,
                         rope=None if rope is None or rope == RopeSpec(theta=rope.theta) else rope,
                         scale=None if scale == d ** -0.5 else scale, window=window, chunk=chunk, sinks=sinks,
                         temperature_floor=temperature_floor, v_head_dim=None if dv == d else dv,
                         v_scale=float(v_scale), out_gate=out_gate)


def _position_settings(module: nn.Module, qualname: str, cfg, d: int):
    """(rope, use_rope, window, chunk, temperature_floor) of an attention module: its layer's mask
    and rotation (module docstring)."""
    idx = getattr(module, "layer_idx", _ctx().layer_idx)
    window, chunk = mask_of(cfg, idx)
    rope_cfg = layer_rope_config(cfg, idx)             # None: its model passes it no rotation (NoPE)
    use_rope = rope_applied(module) and rope_cfg is not None
    temperature_floor = None
    if not use_rope and getattr(module, "attn_temperature_tuning", False):
        temperature_floor = int(getattr(module, "floor_scale", 0) or 0)
        if temperature_floor < 2:
            raise LoweringError(f"{qualname} ({type(module).__name__}): attention temperature tuning of a NoPE layer "
                                f"with floor_scale={temperature_floor} (q scaled by log(position) from position 0) "
                                "is not modelled; set config.attn_temperature_tuning=False")
    rope = rope_of(rope_cfg, d, f"{qualname} ({type(module).__name__})", _layer_type(cfg, idx), _ctx().family) \
        if use_rope else None
    return rope, use_rope, window, chunk, temperature_floor


CLIP_QKV = "clip_qkv"


def _fused_attention_spec(module: nn.Module, qualname: str, d: int) -> AttentionSpec:
    """DBRX's attention: one bias-free projection ``Wqkv`` whose rows are q [H*d], k [G*d], v [G*d]
    (H ``num_heads``, G ``num_key_value_heads``), each clamped to [-c, c] where its forward reads a
    ``clip_qkv`` c, and ``out_proj``; RoPE, mask and scale as any attention's."""
    from moegraph.lowering.hf_common import check_attention
    cfg = getattr(module, "config", None) or _ctx().config
    where = f"{qualname} ({type(module).__name__})"
    qkv_name, o_name = FUSED_ATTENTION
    qkv, out = (_child_class_check(module, qualname, n) for n in FUSED_ATTENTION)
    H, G = getattr(module, "num_heads", None), getattr(module, "num_key_value_heads", None)
    if not isinstance(H, int) or not isinstance(G, int) or qkv.out_features != (H + 2 * G) * d \
            or out.in_features != H * d:
        raise LoweringError(f"{where}: {qkv_name} gives {qkv.out_features} and {o_name} takes {out.in_features} "
                            f"features: not q, k, v of num_heads={H!r}, num_key_value_heads={G!r} heads of {d}")
    if qkv.bias is not None or out.bias is not None:
        raise LoweringError(f"{where}: biases on a fused {qkv_name} or its {o_name} are not modelled")
    check_attention(module, qualname, head_dim=d, structural=True)
    clip = getattr(module, CLIP_QKV, None) if CLIP_QKV in forward_reads(type(module)) else None
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise LoweringError(f"{where}: {CLIP_QKV}={clip!r}: only a clamp to [-c, c], c > 0, is modelled")
    check_children(module, qualname, set(FUSED_ATTENTION))
    rope, use_rope, window, chunk, temperature_floor = _position_settings(module, qualname, cfg, d)
    w = f"{qkv_name}.weight"
    rows = ((0, H * d), (H * d, G * d), (H * d + G * d, G * d))
    q, k, v = (ParamSource(_join(qualname, w), narrow=(0, start, length)) for start, length in rows)
    scale = float(module.scaling)
    return AttentionSpec(q=q, k=k, v=v, o=_src(qualname, f"{o_name}.weight"), heads=H, kv_heads=G, head_dim=d,
                         rope_theta=rope.theta if rope is not None else 0.0, use_rope=use_rope,
                         tuple_output=returns_tuple(type(module)),
                         rope=None if rope is None or rope == RopeSpec(theta=rope.theta) else rope,
                         scale=None if scale == d ** -0.5 else scale, window=window, chunk=chunk,
                         temperature_floor=temperature_floor, qkv_clip=None if clip is None else float(clip))


def _out_gate(module: nn.Module, qualname: str, reads: frozenset[str], H: int,
              dv: int) -> tuple[str | None, OutGateSpec | None]:
    """(child name, gated output) when the forward reads a bias-free linear ``g_proj`` or
    ``gate_proj`` of H (a gate per head) or H*dv outputs; its activation is the one sigmoid or
    softplus the forward calls (read from the source). Where the gate applies (before o_proj, on
    the layer input) is what the numerical check against eager confirms."""
    name = next((n for n in OUT_GATE_NAMES if n in reads and isinstance(module._modules.get(n), nn.Linear)), None)
    if name is None:
        return None, None
    where = f"{_join(qualname, name)!r} ({type(module).__name__})"
    lin = _child_class_check(module, qualname, name)
    if lin.bias is not None or lin.out_features not in (H, H * dv):
        raise LoweringError(f"{where}: an attention output gate of {lin.out_features} outputs"
                            f"{' with a bias' if lin.bias is not None else ''} is not modelled (a bias-free gate of "
                            f"{H} heads or {H * dv} features is)")
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
    acts = {a for a in ("sigmoid", "softplus") if re.search(rf"\b{a}\(", src)}
    if len(acts) != 1:
        raise LoweringError(f"{where}: the attention output gate's activation is not modelled (the forward calls "
                            f"{' and '.join(sorted(acts)) or 'neither sigmoid nor softplus'})")
    return name, OutGateSpec(weight=_src(qualname, f"{name}.weight"), act=acts.pop(),
                             per_head=lin.out_features == H and H != H * dv)


def mla_spec(module: nn.Module, qualname: str) -> MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q (q_a_proj, q_a_layernorm, q_b_proj)
    or a direct q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""
    from moegraph.lowering.hf_common import check_attention
    cfg = getattr(module, "config", None) or _ctx().config
    where = f"{qualname} ({type(module).__name__})"
    low_rank = getattr(module, "q_lora_rank", None) is not None
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"] + \
        (["q_a_proj", "q_a_layernorm", "q_b_proj"] if low_rank else ["q_proj"])
    for name in names:
        if getattr(module, name, None) is None:
            raise LoweringError(f"{where}: no {name}, which multi-head latent attention reads")
        _child_class_check(module, qualname, name)
    check_children(module, qualname, set(names))
    check_attention(module, qualname, head_dim=module.qk_head_dim, structural=True)
    if any(getattr(module, n).bias is not None for n in names if isinstance(getattr(module, n), nn.Linear)):
        raise LoweringError(f"{where}: config.attention_bias=True (biases on q_a_proj, kv_a_proj_with_mqa, o_proj) "
                            "is not supported")
    H = module.num_heads
    if getattr(cfg, "num_key_value_heads", H) != H:
        raise LoweringError(f"{qualname}: num_key_value_heads={cfg.num_key_value_heads} differs from "
                            f"num_attention_heads={H}; MLA expands one k and v per head")
    dr = module.qk_rope_head_dim
    if dr % 2:
        raise LoweringError(f"{qualname}: qk_rope_head_dim={dr} is odd; RoPE rotates pairs")
    window, chunk = mask_of(cfg, getattr(module, "layer_idx", _ctx().layer_idx))
    if window or chunk:
        raise LoweringError(f"{where}: a sliding-window or chunked mask on latent attention is not modelled")
    rope = rope_of(cfg, dr, where, _layer_type(cfg, getattr(module, "layer_idx", _ctx().layer_idx)), _ctx().family)
    p = functools.partial(lambda q, n: _src(q, f"{n}.weight"), qualname)
    scale = float(module.scaling)
    query_scale_from = _position_query_scale(module, cfg, where)
    return MLASpec(q=None if low_rank else p("q_proj"), q_a=p("q_a_proj") if low_rank else None,
                   q_norm=norm_spec(module.q_a_layernorm, f"{qualname}.q_a_layernorm") if low_rank else None,
                   q_b=p("q_b_proj") if low_rank else None, kv_a=p("kv_a_proj_with_mqa"),
                   kv_norm=norm_spec(module.kv_a_layernorm, f"{qualname}.kv_a_layernorm"), kv_b=p("kv_b_proj"),
                   o=p("o_proj"), heads=H, nope_dim=module.qk_nope_head_dim, rope_dim=dr,
                   v_dim=module.v_head_dim, q_rank=module.q_lora_rank, kv_rank=module.kv_lora_rank,
                   rope_theta=rope.theta,
                   rope_interleave=bool(getattr(cfg, "rope_interleave", False)) or rope.interleave,
                   tuple_output=returns_tuple(type(module)),
                   rope=None if rope.inv_freq is None and rope.scaling == 1.0 else rope,
                   scale=None if scale == module.qk_head_dim ** -0.5 else scale, query_scale_from=query_scale_from)


QUERY_SCALE_FN = "get_llama_4_attn_scale"


def _position_query_scale(module: nn.Module, cfg, where: str) -> int | None:
    """P where the forward multiplies the queries by ``get_llama_4_attn_scale(position_ids, beta, P)``
    = 1 + beta log(1 + floor(p / P)) (Mistral 4: rope_parameters' llama_4_scaling_beta and
    original_max_position_embeddings), read from the source; None when it does not or beta is 0."""
    try:
        src = inspect.getsource(inspect.unwrap(type(module).forward))
    except (OSError, TypeError):
        return None
    if QUERY_SCALE_FN not in src:
        return None
    params = getattr(cfg, "rope_parameters", None) or {}
    beta, P = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if not beta:
        return None
    if not isinstance(P, int) or P < 1:
        raise LoweringError(f"{where}: a query scale by position (llama_4_scaling_beta={beta}) with "
                            f"original_max_position_embeddings={P!r} is not modelled")
    return P


def _moe(module: nn.Module, qualname: str) -> MoESpec:
    from moegraph.lowering.structural_ffn import moe_spec
    return moe_spec(module, qualname)


def _mlp(module: nn.Module, qualname: str) -> MLPSpec:
    from moegraph.lowering.structural_ffn import mlp_spec
    return mlp_spec(module, qualname)


_BUILDERS = {"norm": norm_spec, "attention": attention_spec, "mla": mla_spec, "moe": _moe, "mlp": _mlp}
