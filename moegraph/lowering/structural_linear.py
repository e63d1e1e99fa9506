"""Structural lowering of a linear-attention token mixer: Gated DeltaNet (Qwen3-Next's and
Qwen3.5-MoE's ``linear_attention`` layers), read by what it holds (``classify`` in
``moegraph.lowering.structural``): its projections (Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba``
grouped by key head; Qwen3.5-MoE's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), a
depthwise causal ``conv1d``, ``norm`` (a gated RMSNorm), ``out_proj`` and the parameters ``A_log``,
``dt_bias``. What it computes is
``moegraph.delta_kernels``'s module docstring; the numerical check against eager confirms it.
Kimi Delta Attention (Kimi Linear's ``linear_attention`` layers, ``kda_spec``): ``q_proj``, ``k_proj``,
``v_proj``, ``conv1d``, ``forget_gate`` (``f_a_proj``, ``f_b_proj``, ``A_log``, ``dt_bias``: a decay per key
feature), ``b_proj``, the output gate ``g_a_proj``, ``g_b_proj``, ``o_norm`` (sigmoid-gated), ``o_proj``.

Refused by name: a convolution with a bias, not depthwise, or not causal (padding K - 1); an
activation other than SiLU (the convolution's or the gated norm's); projections with biases;
value heads that are not a multiple of the key heads; a forward that does not L2-normalise q and k
in the delta rule; for Kimi's, also a gated norm whose activation is not sigmoid and a forget gate
other than a bias-free low-rank projection with A_log [1, 1, H, 1] and dt_bias [H d].

Notation: h hidden, Hk key heads, Hv value heads (r = Hv/Hk), dk, dv key and value head dims,
K the convolution's width, C = 2 Hk dk + Hv dv its channels.
"""

from __future__ import annotations

import inspect
import textwrap

from torch import nn

from moegraph.lowering import LoweringError
from moegraph.lowering.specs import LinearAttentionSpec
from moegraph.lowering.structural import (DECAY_PARAMS, KDA_CHILDREN, LINEAR_ATTENTION, LINEAR_PROJECTIONS,
                                          _child_class_check, _eps, _src, check_children, forward_reads,
                                          linear_layout)

L2_FLAG = "use_qk_l2norm_in_kernel=True"


def linear_attention_spec(module: nn.Module, qualname: str) -> LinearAttentionSpec:
    """Gated DeltaNet read from its children's shapes and its head attributes (module docstring)."""
    where = f"{qualname or 'the layer'} ({type(module).__name__})"
    layout = linear_layout(dict(module.named_children()))
    if layout == "kda":
        return kda_spec(module, qualname, where)
    projections = LINEAR_PROJECTIONS[layout]
    for name in (*projections, "out_proj"):
        lin = _child_class_check(module, qualname, name)
        if not isinstance(lin, nn.Linear) or lin.bias is not None:
            raise LoweringError(f"{where}: {name} is not a bias-free linear; only that is modelled")
    conv = module.conv1d
    Hk, Hv = int(module.num_k_heads), int(module.num_v_heads)
    dk, dv = int(module.head_k_dim), int(module.head_v_dim)
    C = 2 * Hk * dk + Hv * dv
    if Hv % Hk:
        raise LoweringError(f"{where}: num_v_heads={Hv} is not a multiple of num_k_heads={Hk}; a key head serving "
                            "a whole number of value heads is modelled")
    r = Hv // Hk
    widths = {"in_proj_qkvz": Hk * (2 * dk + 2 * r * dv), "in_proj_ba": 2 * Hv, "in_proj_qkv": C,
              "in_proj_z": Hv * dv, "in_proj_b": Hv, "in_proj_a": Hv}
    gives = {name: getattr(module, name).out_features for name in projections}
    if any(gives[name] != widths[name] for name in projections) or module.out_proj.in_features != Hv * dv:
        raise LoweringError(f"{where}: {', '.join(f'{k} gives {v}' for k, v in gives.items())} and out_proj takes "
                            f"{module.out_proj.in_features} features: not {Hk} key heads of {dk} and {Hv} value "
                            f"heads of {dv}")
    if type(conv) is not nn.Conv1d or conv.bias is not None or conv.groups != C or conv.in_channels != C \
            or conv.out_channels != C or conv.stride != (1,) or conv.dilation != (1,) \
            or conv.padding != (conv.kernel_size[0] - 1,):
        raise LoweringError(f"{where}: its conv1d ({conv}) is not a bias-free causal depthwise convolution of "
                            f"its {C} q, k and v channels, the one modelled")
    for owner, act in ((type(module).__name__, getattr(module, "activation", None)),
                       (type(module.norm).__name__, getattr(module.norm, "activation", None))):
        if act != "silu":
            raise LoweringError(f"{where}: {owner}'s activation {act!r} is not modelled (SiLU is)")
    norm = _child_class_check(module, qualname, "norm")
    eps = _eps(norm)
    if eps is None or tuple(norm.weight.shape) != (dv,):
        raise LoweringError(f"{where}: its norm ({type(norm).__name__}) is not a gated RMSNorm over each value "
                            f"head's {dv} features")
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
    reads = forward_reads(type(module))
    if L2_FLAG not in src.replace(" ", "") or not set(DECAY_PARAMS) <= reads:
        raise LoweringError(f"{where}: its forward does not call the delta rule with q and k L2-normalised "
                            f"({L2_FLAG}) and the decay of {' and '.join(DECAY_PARAMS)}: not the Gated DeltaNet "
                            "modelled")
    check_children(module, qualname, {*LINEAR_ATTENTION, *projections})
    w = {name: _src(qualname, f"{name}.weight") for name in projections}
    grouped = layout == "grouped"
    return LinearAttentionSpec(qkvz=w["in_proj_qkvz" if grouped else "in_proj_qkv"], ba=w.get("in_proj_ba"),
                               conv=_src(qualname, "conv1d.weight"), a_log=_src(qualname, "A_log"),
                               dt_bias=_src(qualname, "dt_bias"), norm=_src(qualname, "norm.weight"),
                               out=_src(qualname, "out_proj.weight"), k_heads=Hk, v_heads=Hv, k_dim=dk, v_dim=dv,
                               conv_size=int(conv.kernel_size[0]), eps=eps, layout=layout, z=w.get("in_proj_z"),
                               b=w.get("in_proj_b"), a=w.get("in_proj_a"))


def _bias_free_linears(module: nn.Module, qualname: str, where: str, names) -> None:
    for name in names:
        lin = _child_class_check(module, qualname, name)
        if not isinstance(lin, nn.Linear) or lin.bias is not None:
            raise LoweringError(f"{where}: {name} is not a bias-free linear; only that is modelled")


def kda_spec(module: nn.Module, qualname: str, where: str) -> LinearAttentionSpec:
    """Kimi Delta Attention (Kimi Linear's ``linear_attention`` layers): q_proj, k_proj, v_proj of H heads
    of d, a causal depthwise conv1d over them, beta = sigmoid(b_proj), the forget gate's decay per key
    feature -exp(A_log) softplus(f_b_proj(f_a_proj(x)) + dt_bias), the output gate sigmoid(g_b_proj(g_a_proj(x)))
    on the RMSNorm o_norm, o_proj (layout 'kda' of ``moegraph.delta_kernels``)."""
    gate = _child_class_check(module, qualname, "forget_gate")
    fq = f"{qualname}.forget_gate" if qualname else "forget_gate"
    if not all(hasattr(gate, n) for n in ("f_a_proj", "f_b_proj", "A_log", "dt_bias")):
        raise LoweringError(f"{where}: its forget_gate ({type(gate).__name__}) does not hold f_a_proj, f_b_proj, A_log "
                            "and dt_bias, the low-rank per-channel decay modelled")
    _bias_free_linears(module, qualname, where, [n for n in KDA_CHILDREN if n.endswith("_proj")])
    _bias_free_linears(gate, fq, f"{fq} ({type(gate).__name__})", ("f_a_proj", "f_b_proj"))
    H, d = int(module.num_heads), int(module.head_dim)
    rank = module.g_a_proj.out_features
    widths = {"q_proj": H * d, "k_proj": H * d, "v_proj": H * d, "b_proj": H, "g_b_proj": H * d}
    if any(getattr(module, n).out_features != w for n, w in widths.items()) or module.o_proj.in_features != H * d \
            or module.g_b_proj.in_features != rank or gate.f_a_proj.out_features != rank \
            or gate.f_b_proj.in_features != rank or gate.f_b_proj.out_features != H * d \
            or gate.A_log.numel() != H or tuple(gate.dt_bias.shape) != (H * d,):
        raise LoweringError(f"{where}: its projections, forget gate (A_log {tuple(gate.A_log.shape)}, dt_bias "
                            f"{tuple(gate.dt_bias.shape)}) and o_proj are not {H} heads of {d} with one gate rank "
                            f"{rank}, the layout modelled")
    if tuple(gate.A_log.shape) != (1, 1, H, 1):
        raise LoweringError(f"{where}: its forget gate's A_log {tuple(gate.A_log.shape)} is not [1, 1, {H}, 1], "
                            "the layout modelled")
    conv, C = module.conv1d, 3 * H * d
    if type(conv) is not nn.Conv1d or conv.bias is not None or conv.groups != C or conv.in_channels != C \
            or conv.out_channels != C or conv.stride != (1,) or conv.dilation != (1,) \
            or conv.padding != (conv.kernel_size[0] - 1,):
        raise LoweringError(f"{where}: its conv1d ({conv}) is not a bias-free causal depthwise convolution of "
                            f"its {C} q, k and v channels, the one modelled")
    norm = _child_class_check(module, qualname, "o_norm")
    for owner, act, want in ((type(module).__name__, getattr(module, "activation", None), "silu"),
                             (type(norm).__name__, getattr(norm, "activation", None), "sigmoid")):
        if act != want:
            raise LoweringError(f"{where}: {owner}'s activation {act!r} is not modelled ({want} is)")
    eps = _eps(norm)
    if eps is None or tuple(norm.weight.shape) != (d,):
        raise LoweringError(f"{where}: its o_norm ({type(norm).__name__}) is not a gated RMSNorm over each head's "
                            f"{d} features")
    src = textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
    if L2_FLAG not in src.replace(" ", "") or "forget_gate" not in forward_reads(type(module)):
        raise LoweringError(f"{where}: its forward does not call the delta rule with q and k L2-normalised "
                            f"({L2_FLAG}) and the forget gate's decay: not the Kimi Delta Attention modelled")
    check_children(module, qualname, set(KDA_CHILDREN))
    check_children(gate, fq, {"f_a_proj", "f_b_proj"})
    p = lambda name: _src(qualname, f"{name}.weight")  # noqa: E731
    f = lambda name: _src(fq, name)  # noqa: E731
    return LinearAttentionSpec(qkvz=p("q_proj"), ba=None, conv=p("conv1d"), a_log=f("A_log"), dt_bias=f("dt_bias"),
                               norm=p("o_norm"), out=p("o_proj"), k_heads=H, v_heads=H, k_dim=d, v_dim=d,
                               conv_size=int(conv.kernel_size[0]), eps=eps, layout="kda", z=p("g_b_proj"),
                               b=p("b_proj"), a=f("f_b_proj.weight"), k=p("k_proj"), v=p("v_proj"),
                               z_down=p("g_a_proj"), a_down=f("f_a_proj.weight"), gate_rank=rank)
