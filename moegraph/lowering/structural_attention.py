"""Structural lowering of a decoder layer's attention: GQA (separate or fused q/k/v projections) and
multi-head latent attention, their masks, RoPE, norms, gates and scales. See
``moegraph.lowering.structural`` for how blocks are recognised and the guard; this module reads the
two attention kinds (module docstring there).

Notation: h hidden, H query heads, G kv heads, d head dim, dv value head dim.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

from torch import nn

from moegraph.ir import ParamSource
from moegraph.lowering import LoweringError
from moegraph.lowering.rope import layer_rope_config, rope_of
from moegraph.lowering.specs import AttentionSpec, MLASpec, OutGateSpec, RopeSpec
from moegraph.lowering.structural import (FUSED_ATTENTION, _child_class_check, _ctx, _eps, _join, _layer_type, _src,
                                          check_children, forward_reads, mask_of, norm_spec, returns_tuple)


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
    if getattr(module, "is_kv_shared_layer", False):
        raise LoweringError(f"{qualname} ({type(module).__name__}): is_kv_shared_layer=True (config."
                            "num_kv_shared_layers): keys and values shared from an earlier layer are not modelled")
    v_from_k = _values_are_keys(module, qualname, reads)
    for name in ("q_proj", "k_proj", "o_proj") + (() if v_from_k else ("v_proj",)):
        _child_class_check(module, qualname, name)
    H, G = module.q_proj.out_features // d, module.k_proj.out_features // d
    q_gate = _fused_q_gate(module)
    H //= 2 if q_gate else 1                             # Qwen3-Next: q_proj gives each head's query and gate
    v_lin = module.k_proj if v_from_k else module.v_proj
    dv = v_lin.out_features // G                         # the value heads' width (MiMo-V2-Flash: not d)
    if v_lin.out_features != G * dv or module.o_proj.in_features != H * dv:
        raise LoweringError(f"{qualname} ({type(module).__name__}): v_proj gives {v_lin.out_features} and "
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
    projs = ("q_proj", "k_proj") + (() if v_from_k else ("v_proj",))
    biases = [getattr(module, n).bias for n in projs]
    qkv_bias = tuple(_src(qualname, f"{n}.bias") for n in projs) if all(b is not None for b in biases) else None
    o_bias = _src(qualname, "o_proj.bias") if module.o_proj.bias is not None else None
    q_norm = k_norm = l2 = None
    per_head = after = False
    known = {"q_proj", "k_proj", "v_proj", "o_proj"}
    v_norm = _value_norm(module, qualname, reads, known)
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
    if q_gate:
        if out_gate is not None or dv != d:
            raise LoweringError(f"{qualname} ({type(module).__name__}): a gate from q_proj beside a {gate_name} gate, "
                                f"or value heads of {dv} features (not the gate's {d}), is not modelled")
        out_gate = OutGateSpec(weight=None, act="sigmoid", per_head=False)
    check_children(module, qualname, known)
    sinks = _src(qualname, "sinks") if getattr(module, "sinks", None) is not None and "sinks" in reads else None
    scale = float(module.scaling)
    return AttentionSpec(q=_src(qualname, "q_proj.weight"), k=_src(qualname, "k_proj.weight"),
                         v=_src(qualname, ("k_proj" if v_from_k else "v_proj") + ".weight"),
                         o=_src(qualname, "o_proj.weight"), heads=H, kv_heads=G, v_from_k=v_from_k, v_norm_eps=v_norm,
                         head_dim=d, rope_theta=rope.theta if rope is not None else 0.0, use_rope=use_rope,
                         tuple_output=returns_tuple(type(module)), qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
                         qk_norm_per_head=per_head, qk_norm_after_rope=after, qk_l2_eps=l2, o_bias=o_bias,
                         rope=None if rope is None or rope == RopeSpec(theta=rope.theta) else rope,
                         scale=None if scale == d ** -0.5 else scale, window=window, chunk=chunk, sinks=sinks,
                         temperature_floor=temperature_floor, v_head_dim=None if dv == d else dv,
                         v_scale=float(v_scale), out_gate=out_gate)


def _values_are_keys(module: nn.Module, qualname: str, reads: frozenset[str]) -> bool:
    """Whether the values are the key projection's output (Gemma 4's ``attention_k_eq_v`` on its full
    layers: ``v_proj`` is None and the forward uses the keys before their norm and RoPE)."""
    if "v_proj" in module._modules or "v_proj" not in reads:
        return False
    if getattr(module, "v_proj", 0) is None and getattr(module, "use_alternative_attention", False):
        return True
    raise LoweringError(f"{qualname} ({type(module).__name__}): no v_proj: values other than a v_proj's or (Gemma 4's "
                        "attention_k_eq_v) the k_proj's are not modelled")


def _value_norm(module: nn.Module, qualname: str, reads: frozenset[str], known: set[str]) -> float | None:
    """The eps of a weightless RMSNorm of each value head the forward reads (Gemma 4's ``v_norm``;
    added to ``known``), else None; a v_norm with a weight, or not an RMSNorm, is refused by name."""
    from moegraph.lowering.structural import weightless_rms_eps
    child = module._modules.get("v_norm")
    if child is None or "v_norm" not in reads:
        return None
    _child_class_check(module, qualname, "v_norm")
    eps = weightless_rms_eps(child)
    if eps is None:
        raise LoweringError(f"{qualname}.v_norm ({type(child).__name__}): a value norm with a weight, or other than "
                            "an RMSNorm of each head, is not modelled (a weightless RMSNorm is)")
    known.add("v_norm")
    return eps


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


FUSED_Q_GATE = (r"torch\.chunk\(\s*self\.q_proj\(", r"\bsigmoid\(gate\)")
"""Qwen3-Next's gated attention, read from its forward: q_proj's output viewed per head [2d] and
chunked into the query and the output gate's logits, the attention output times sigmoid(gate)."""


def _fused_q_gate(module: nn.Module) -> bool:
    """Whether q_proj gives each head's query and then its output gate's logits (twice o_proj's input
    features, and the forward's FUSED_Q_GATE lines); the numerical check confirms the layout."""
    if module.q_proj.out_features != 2 * module.o_proj.in_features:
        return False
    try:
        src = inspect.getsource(inspect.unwrap(type(module).forward))
    except (OSError, TypeError):
        return False
    return all(re.search(p, src) for p in FUSED_Q_GATE)


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
    if _calls_rotary(module):
        rope = rope_of(cfg, dr, where, _layer_type(cfg, getattr(module, "layer_idx", _ctx().layer_idx)), _ctx().family)
    else:     # NoPE (Kimi Linear's MLA): k_pe shared by every head, unrotated; zero frequencies rotate by nothing
        rope = RopeSpec(theta=float(getattr(cfg, "rope_theta", None) or 10000.0), inv_freq=(0.0,) * (dr // 2))
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


def _calls_rotary(module: nn.Module) -> bool:
    """Whether the module's forward calls anything named for a rotation (``apply_rotary_pos_emb``...);
    an unreadable source counts as rotating (the numerical check decides)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward))))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(n, ast.Call) and any(w in ast.unparse(n.func).lower() for w in ("rotary", "rope"))
               for n in ast.walk(tree))


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
